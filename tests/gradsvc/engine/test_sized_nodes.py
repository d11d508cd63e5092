"""Nodes whose output's size depends on values (`x[mask]`, `nonzero`) in a graph recorded on one batch: the
node carries the size it had (OpNode.shape); the meta check takes it, the run checks it, and no other op may
claim a size."""

from __future__ import annotations

import pytest
import torch

from gradsvc.engine import SpecError
from gradsvc.engine.graph.meta_check import validate_graph_shapes

from .test_graph import LIMITS, X, graph_model, refused, spec

W = {"name": "w", "kind": "parameter", "target": "fc.weight", "dtype": "float32", "shape": [2, 3]}
MASKED = [{"name": "y", "op": "aten.linear.default", "args": [{"node": "x"}, {"node": "w"}]},
          {"name": "m", "op": "aten.gt.Scalar", "args": [{"node": "y"}, 0.0]},
          {"name": "z", "op": "aten.index.Tensor", "args": [{"node": "y"}, [{"node": "m"}]], "shape": [3]},
          {"name": "s", "op": "aten.sum.default", "args": [{"node": "z"}]}]


def test_a_masked_index_runs_with_its_recorded_size_and_checks_it():
    x = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    gm = graph_model(spec(MASKED, inputs=[X, W]), {"fc.weight": torch.tensor([[1.0, 1.0, 0.0], [1.0, -1.0, 0.0]])})
    out = validate_graph_shapes(graph_model(spec(MASKED, inputs=[X, W]), {"fc.weight": torch.ones(2, 3)}).to("meta"),
                                x.to("meta"), limits=LIMITS)
    assert out.shape == () and out.requires_grad  # the picked values carry the gradient on meta too
    y = x @ torch.tensor([[1.0, 1.0, 0.0], [1.0, -1.0, 0.0]]).t()
    assert int((y > 0).sum()) == 3 and torch.allclose(gm(x), y[y > 0].sum())
    with pytest.raises(SpecError) as err:
        gm(torch.zeros(3, 3))  # another batch picks another number of values (none)
    assert err.value.code == "shape_mismatch" and "[3]" in err.value.message


def test_only_an_op_whose_size_depends_on_values_may_carry_a_size():
    nodes = [{"name": "y", "op": "aten.linear.default", "args": [{"node": "x"}, {"node": "w"}], "shape": [9, 9]}]
    assert "'shape' is given only" in refused(spec(nodes, inputs=[X, W]), "bad_option").message
