"""Memory inside an op: scaled_dot_product_attention's math kernel (options.hvp) builds a batch x heads x L x S
attention matrix that no node's output shows; it counts against the element limit before the queue."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc.engine import EngineConfig, SpecError, prepare
from gradsvc.engine.spec import Limits
from gradsvc.wire import GradientRequest


class Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):  # (batch, heads, L, 1)
        q = x * self.scale
        return F.scaled_dot_product_attention(q, x, x).sum((1, 2))  # (batch, 1)


def request(length: int, **options) -> GradientRequest:
    x = torch.randn(1, 1, length, 1)
    eg = export_graph(Attend(), (x,))
    body = {"model": {"graph": eg.graph, "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": {"dtype": "float32", "shape": [1, 1, length, 1]}, "targets": {"dtype": "float32", "shape": [1, 1]},
            "loss": "mse", "options": {"numcheck": "off", **options}}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def test_the_attention_matrix_of_hvp_counts_against_the_element_limit():
    config = EngineConfig(limits=Limits(max_elements=1 << 20))
    prepare(request(512), config, shape_only=True)  # 512 x 512 = 262k: fine either way
    prepare(request(2048), config, shape_only=True)  # 4.2M attention elements, but no math kernel without hvp
    with pytest.raises(SpecError) as err:
        prepare(request(2048, hvp={"vector": "random"}), config, shape_only=True)
    assert err.value.code == "too_large" and "attention matrix of 4194304 elements" in err.value.message
