"""Imports point one way: the API imports from workers/ only the engine (pure PyTorch, to validate on the
meta device); the queue's format lives in gradsvc/queue.py, which both sides read."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_service_imports_nothing_from_workers_but_the_engine():
    pattern = re.compile(r"^\s*(?:from|import)\s+(?:gradsvc\.)?workers(?:\.(\w+))?", re.M)
    offenders = [(p.name, m.group(0).strip()) for p in (ROOT / "service").rglob("*.py")
                 for m in pattern.finditer(p.read_text()) if m.group(1) != "engine"]
    assert offenders == []


def test_the_sdk_imports_neither_the_service_nor_the_workers():
    pattern = re.compile(r"^\s*(?:from|import)\s+(?:gradsvc\.)?(?:service|workers)\b", re.M)
    offenders = [p.name for p in (ROOT / "gradclient").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
