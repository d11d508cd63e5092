"""The API's check on meta of a graph's weights sent by reference (refs, no bytes: their bytes are in Redis, and a
worker checks them when it puts them in place): checked by their dtype and shape without a tensor made for each,
with the same refusals the full decode gives."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
import torch
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc.engine import Engine
from gradsvc.engine.decode import check_by_reference, decode_weights
from gradsvc.engine.errors import SpecError
from gradsvc.wire import GradientRequest, Tensor


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _request(change: dict | None = None) -> GradientRequest:
    """A second call's body as the API reads it: every weight by its refs alone but `0.bias`, inline;
    `change`: a weight's wire fields replaced."""
    model, x = _net(), torch.randn(5, 6)
    exported = export_graph(model, (x,))
    weights = {}
    for k, v in exported.weights.items():
        wire = to_wire(v, "msgpack")
        weights[k] = wire if k == "0.bias" else Tensor(dtype=wire.dtype, shape=wire.shape,
                                                        refs=[hashlib.sha256(wire.data).hexdigest()])
    for k, fields in (change or {}).items():
        weights[k] = msgspec.structs.replace(weights[k], **fields)
    body = {"model": {"graph": exported.graph, "dtype": "float32", "weights": weights},
            "inputs": to_wire(x, "msgpack"), "targets": to_wire(torch.tensor([0, 1, 2, 0, 1]), "msgpack"),
            "loss": "cross_entropy", "options": {"numcheck": "off", "memory": False}}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def test_weights_by_reference_pass_the_check_on_meta_and_only_the_inline_ones_are_decoded():
    req = _request()
    prep = Engine().prepare(req, "meta")
    template = prep.graph
    given = req.model.weights
    rest = check_by_reference(given, template.state, 1 << 30, "the graph", {})
    assert set(rest) == {"0.bias"}  # the inline one, left to decode_weights
    full = decode_weights(given, template.state, template.parameters, torch.float32, 1 << 30, "the graph")
    assert set(full) == set(given) and full["0.weight"].is_meta  # decode_weights: a meta tensor each


@pytest.mark.parametrize(("change", "code", "words"), [
    ({"3.weight": {"shape": [4, 8]}}, "bad_weights", "'3.weight' has shape [4, 8], the graph needs [3, 8]"),
    ({"0.weight": {"dtype": "float8"}}, "bad_tensor", "weights['0.weight']"),
    ({"0.weight": {"dtype": "complex64"}}, "bad_tensor", "complex64"),
    ({"1.running_mean": {"shape": [8, -1]}}, "bad_tensor", "shape [8, -1] is invalid"),
])
def test_a_wrong_weight_by_reference_is_refused_on_meta_as_the_full_decode_refuses_it(change, code, words):
    req = _request(change)
    with pytest.raises(SpecError) as got:
        Engine().prepare(req, "meta")
    assert got.value.code == code and words in got.value.message
    template = Engine().prepare(_request(), "meta").graph
    with pytest.raises(SpecError) as full:  # decode_weights says the same
        decode_weights(req.model.weights, template.state, template.parameters, torch.float32, 1 << 30, "the graph")
    assert (full.value.code, full.value.message) == (got.value.code, got.value.message)
