"""Op coverage counted from what programs emit (tests/support/emitted_ops.py): one sample of every op_db op
and of every module_db module, recorded as the SDK's trace capture records them (the ATen program the forward
runs); with GRADSVC_TEST_ALL=1 every sample, and torch.export's graphs too. Every op they emit is allowed or
refused with a reason written in ops.REFUSED and docs/graph-ops.md; the figure the docs state is this one."""

from __future__ import annotations

import functools
import pathlib
import re

import pytest

from gradsvc.engine.graph.ops import OPS, REFUSED

from tests.support import emitted_ops
from tests.support.suite import TEST_ALL

ROOT = pathlib.Path(__file__).resolve().parents[3]


@functools.cache
def measured() -> emitted_ops.Emitted:
    per = 1000 if TEST_ALL else 1
    return emitted_ops.measure(per, per, export=TEST_ALL)


@pytest.mark.timeout(1800)
def test_every_op_programs_emit_is_allowed_or_refused_with_a_reason():
    found = measured()
    allowed, refused, neither = emitted_ops.coverage(found)
    print("\n" + emitted_ops.figure(found))
    assert not neither, "ops op_db/module_db programs emit, neither allowed nor refused with a reason (ops.REFUSED): " \
                        + ", ".join(f"{op} ({sorted(found.ops[op])[0]})" for op in neither)
    assert found.programs > 600 and len(found.ops) > 300  # the tables are still read
    assert found.captured >= found.programs - 5, found.failed  # a forward that runs is captured


@pytest.mark.timeout(1800)
def test_the_docs_and_the_readme_state_the_figure_and_every_refusal_with_its_reason():
    if TEST_ALL:
        pytest.skip("the docs state the figure of one sample per op and module (make test's)")
    found = measured()
    allowed, refused, _ = emitted_ops.coverage(found)
    figure = f"{len(allowed)} of {len(found.ops)}"
    doc = (ROOT / "docs" / "graph-ops.md").read_text()
    assert figure in doc, f"docs/graph-ops.md does not state the measured figure {figure}"
    assert figure in (ROOT / "README.md").read_text(), f"README.md does not state the measured figure {figure}"
    for op, why in REFUSED.items():
        line = next((ln for ln in doc.splitlines() if f"`{op}`" in ln), "")
        assert len(line) > 60, f"docs/graph-ops.md does not say why {op} is refused"
        assert op not in OPS
    assert re.search(r"python -m tests\.support\.emitted_ops", doc)
