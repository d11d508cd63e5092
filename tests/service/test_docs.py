"""docs/api.md is the contract users read: every error code, option, result field, route and setting in the
code appears in it, its error table agrees with the code's statuses, and nothing points users to a file
they do not have (DESIGN.md)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgspec
import pytest

from gradsvc import wire
from gradsvc.runtime.settings import Settings
from service.exceptions import STATUS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def error_table(text: str) -> dict[str, int]:
    section = text.split("## Errors", 1)[1].split("\n## ", 1)[0]
    return {code: int(status) for code, status in re.findall(r"^\| `([a-z_]+)` \| (\d{3}) \|", section, flags=re.M)}


def test_every_error_code_is_documented_with_its_status(doc):
    table = error_table(doc)
    assert table == STATUS, {c: (table.get(c), STATUS.get(c)) for c in set(table) ^ set(STATUS) |
                             {c for c in table if table[c] != STATUS.get(c)}}
    assert set(table) == set(wire.ERROR_CODES)  # the one table (tests/gradsvc/test_error_table.py)


def test_every_option_is_documented(doc):
    section = doc.split("### Options", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M))
    for field in msgspec.structs.fields(wire.Options):
        assert field.encode_name in rows, field.encode_name


def test_every_result_field_is_documented(doc):
    text = " ".join(doc.split())
    for struct in (wire.GradientResult, wire.Timings, wire.Numcheck, wire.ParameterCheck, wire.Memory,
                   wire.LayerMemory, wire.JobInfo, wire.Progress, wire.Estimate, wire.LayerInfo, wire.ErrorBody,
                   wire.ModelSpec, wire.LossSpec, wire.GraphSpec, wire.OpNode, wire.GraphInput):
        for field in msgspec.structs.fields(struct):
            assert re.search(rf"\b{field.encode_name}\b", text), f"{struct.__name__}.{field.encode_name}"


def test_every_setting_is_documented(doc):
    words = " ".join(doc.split())
    for field in dataclasses.fields(Settings):
        if field.name in ("redis_url_given", "limits_given"):  # derived, not a variable
            continue
        assert f"`GRADSVC_{field.name.upper()}`" in words, field.name


def test_every_route_is_documented(doc):
    from service import openapi

    for path, methods in openapi.build(300)["paths"].items():
        for method in methods:
            documented = path.replace("{job_id}", "{id}").replace("{session_id}", "{id}")
            assert f"`{method.upper()} {documented}" in doc, (method, path)


def test_every_header_and_tag_the_schema_declares_is_documented(doc):
    from service import openapi

    built = openapi.build(300)
    named = {t["name"] for t in built["tags"]}
    for methods in built["paths"].values():
        for op in methods.values():
            named |= {p["name"] for p in op.get("parameters", []) if p["in"] == "header"}
            named |= {h for response in op["responses"].values() for h in response.get("headers", {})}
    assert {"Idempotency-Key", "Gradsvc-Release-Results", "Location", "Retry-After"} <= named
    for name in named:
        assert f"`{name}`" in doc, name


def test_the_generator_commands_documented_are_those_the_tests_run(doc):
    """docs/api.md's commands for openapi-python-client and openapi-typescript, as
    tests/integration/test_generated_clients.py runs them against a live stack."""
    test = (ROOT / "tests" / "integration" / "test_generated_clients.py").read_text()
    assert "openapi-python-client generate --url http://127.0.0.1:8000/schema --meta none" in doc
    assert '"generate", "--url"' in test and '"--meta", "none"' in test
    assert "npx openapi-typescript http://127.0.0.1:8000/schema -o schema.d.ts" in doc
    assert '"openapi-typescript"' in test and '"-o"' in test


def test_users_are_pointed_to_docs_api_md_not_design_md():
    for path in [ROOT / "README.md", *ROOT.glob("gradclient/**/*.py"), *ROOT.glob("service/**/*.py"),
                 *ROOT.glob("gradsvc/**/*.py"), *ROOT.glob("workers/**/*.py"), *ROOT.glob("examples/*.py")]:
        assert "DESIGN.md" not in path.read_text(), path
    assert "docs/api.md" in (ROOT / "README.md").read_text()


def test_the_202_body_is_documented_with_every_field_it_carries(doc):
    """The route table names every field of the 202 body (`progress` too, not only `{job_id, status}`)."""
    row = next(line for line in doc.splitlines() if line.startswith("| `POST /gradients"))
    shown = re.search(r"202 `\{([^}]*)\}`", row)[1]
    assert [f.strip() for f in shown.split(",")] == list(wire.JobAccepted.__struct_fields__)


def test_the_models_page_counts_the_layer_types_get_layers_lists():
    """The count of layer types says the two containers apart from the entries GET /layers lists."""
    from gradsvc.engine import layer_catalogue

    entries = layer_catalogue()
    text = (ROOT / "docs" / "models.md").read_text()
    m = re.search(r"(\d+) layer types, plus the two containers\n\(`GET /layers` lists all (\d+) entries", text)
    assert m, "docs/models.md says how many layer types GET /layers lists"
    containers = [e for e in entries if e.get("container")]
    assert (int(m[1]), int(m[2]), len(containers)) == (len(entries) - len(containers), len(entries), 2)
