"""Op coverage as a measured figure: every op of PyTorch's core ATen opset (the overloads tagged
torch.Tag.core) that has a derivative formula (torch's own derivatives.yaml, as torchgen ships it) is on
the allow-list, or refused with its reason written in gradsvc/engine/graph/ops.py and docs/graph-ops.md."""

from __future__ import annotations

import functools
import pathlib
import re

import msgspec
import pytest
import torch
import torchgen
import yaml

from gradsvc.engine.graph.compiler import build_graph
from gradsvc.engine.graph.ops import OPS, REFUSED_CORE
from gradsvc.wire import GraphSpec

from .test_graph import LIMITS

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser: 0.1 s where the Python one takes 0.6
DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "graph-ops.md"


@functools.cache
def core_ops() -> list[str]:
    out = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            out += [f"{name}.{ov}" for ov in packet.overloads() if torch.Tag.core in getattr(packet, ov).tags]
    return sorted(out)


@functools.cache
def with_derivative_formula() -> frozenset[str]:
    path = pathlib.Path(torchgen.__file__).parent / "packaged" / "autograd" / "derivatives.yaml"
    names = set()
    for entry in yaml.load(path.read_text(), Loader=_LOADER):
        base, _, overload = entry["name"].split("(", 1)[0].partition(".")
        names.add(f"{base}.{overload or 'default'}")
    return frozenset(names)


def test_every_core_aten_op_with_a_derivative_formula_is_allowed_or_refused_with_a_reason():
    core = core_ops()
    differentiable = [op for op in core if op in with_derivative_formula()]
    allowed = [op for op in differentiable if f"aten.{op}" in OPS]
    unaccounted = [op for op in differentiable if f"aten.{op}" not in OPS and op not in REFUSED_CORE]
    print(f"\ncore ATen opset: {len(allowed)} of {len(differentiable)} ops with a derivative formula allowed "
          f"({len(core)} core ops, {sum(f'aten.{op}' in OPS for op in core)} allowed); refused: {sorted(REFUSED_CORE)}")
    assert not unaccounted, f"core ops with a derivative formula, neither allowed nor refused with a reason: " \
                            f"{unaccounted}"
    assert len(differentiable) >= 150  # the reading of torch's tables still finds the opset
    assert len(allowed) == len(differentiable) - len(REFUSED_CORE)
    assert not any(f"aten.{op}" in OPS for op in REFUSED_CORE)


def test_docs_state_the_figure_and_every_refused_op_with_its_reason():
    text = DOC.read_text()
    differentiable = [op for op in core_ops() if op in with_derivative_formula()]
    allowed = sum(f"aten.{op}" in OPS for op in differentiable)
    assert f"{allowed} of {len(differentiable)}" in text
    for op in REFUSED_CORE:
        line = next((ln for ln in text.splitlines() if f"`aten.{op}`" in ln), "")
        assert len(line) > 60, f"docs/graph-ops.md does not say why aten.{op} is refused"


@pytest.mark.parametrize("op", sorted(REFUSED_CORE))
def test_a_refused_core_op_is_an_unsupported_op_saying_why(op):
    spec = {"version": 1, "dtype": "float32", "outputs": [{"node": "z"}],
            "inputs": [{"name": "x", "kind": "input", "dtype": "float32", "shape": [2, 3], "batch_dim": 0}],
            "nodes": [{"name": "z", "op": f"aten.{op}", "args": [{"node": "x"}]}]}
    graph = msgspec.convert(spec, GraphSpec)
    with pytest.raises(Exception) as err:
        build_graph(graph, limits=LIMITS)
    assert err.value.code == "unsupported_op"
    assert re.sub(r"\s+", " ", REFUSED_CORE[op])[:40] in err.value.message
