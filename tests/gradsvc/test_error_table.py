"""The error codes are one table (gradsvc.wire.ERROR_CODES), every code in it is raised somewhere, and
no other module keeps a code -> status table of its own."""

from __future__ import annotations

import re
from pathlib import Path

from gradsvc.wire import ERROR_CODES

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("service", "workers", "gradclient", "gradsvc") for p in (ROOT / d).rglob("*.py")]


def _text(path: Path) -> str:
    return path.read_text()


def test_no_module_but_the_wire_maps_a_code_to_a_status():
    pattern = re.compile(r'"(%s)"\s*:\s*\d{3}\b' % "|".join(ERROR_CODES))
    offenders = [str(p.relative_to(ROOT)) for p in SOURCES if pattern.search(_text(p))]
    assert offenders == []


def test_every_code_in_the_table_is_raised_by_the_api_or_a_worker():
    raising = "\n".join(_text(p) for p in SOURCES if p.parts[-3:] != ("gradsvc", "wire", "errors.py"))
    unused = [code for code in ERROR_CODES if f'"{code}"' not in raising]
    assert unused == []


def test_each_code_has_one_exception_class_name_and_a_parent_kind():
    names = [entry.exception for entry in ERROR_CODES.values()]
    assert len(names) == len(set(names)) and all(n.endswith("Error") for n in names)
    assert {entry.kind for entry in ERROR_CODES.values()} <= {"request", "job", "unavailable", "server"}
