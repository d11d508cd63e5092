"""A custom autograd Function's own backward, run by the engine: one that returns a gradient of the wrong shape
is the request's fault, a coded error naming the Function, not a gradsvc bug."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc.engine import EngineConfig, SpecError, compute
from gradsvc.wire import GradientRequest


class SummedScale(torch.autograd.Function):
    """x * w, whose backward (wrongly) returns x's gradient summed over the batch: shape (3,), not (batch, 3)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return (g * w).sum(0), (g * x).sum(0)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.randn(3))
        self.last = nn.Linear(3, 2)

    def forward(self, x):
        return self.last(SummedScale.apply(self.first(x), self.scale))


def test_a_functions_backward_returning_the_wrong_shape_is_shape_mismatch_naming_the_function():
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(5, 4), torch.tensor([0, 1, 1, 0, 1])
    eg = export_graph(model, (x,))
    body = {"model": {"graph": eg.graph, "dtype": "float32", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "cross_entropy", "options": {"numcheck": "off"}}
    req = msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)
    with pytest.raises(SpecError) as refused:
        compute(req, EngineConfig())
    error = refused.value
    assert error.code == "shape_mismatch" and error.detail["function"] == "SummedScale"
    assert error.detail["expected"] == [5, 3] and error.detail["got"] == [3]
    assert "SummedScale" in error.message and "argument 0" in error.message
