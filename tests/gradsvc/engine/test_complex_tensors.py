"""complex64 and complex128 on the wire: raw interleaved little-endian bytes (MessagePack data, JSON b64) and
nested [real, imaginary] pairs, decoded by the engine and the SDK alike; results come back the same way."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradclient import tensors as sdk
from gradsvc import wire
from gradsvc.engine import EngineConfig, compute, tensors
from gradsvc.engine.errors import SpecError


def rotary_table(dtype: torch.dtype) -> torch.Tensor:
    angles = torch.outer(torch.arange(3.0), torch.tensor([1.0, 0.1]))
    return torch.polar(torch.ones_like(angles), angles).to(dtype)  # (3, 2)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_complex_tensors_travel_from_the_sdk_to_the_engine_and_back(dtype, fmt):
    t = rotary_table(dtype)
    codec = msgspec.json if fmt == "json" else msgspec.msgpack
    sent = codec.decode(codec.encode(sdk.to_wire(t, fmt)), type=wire.Tensor)
    got = tensors.decode(sent, where="x", max_elements=100, complex_ok=True)
    assert got.dtype == dtype and torch.equal(got, t)
    back = codec.decode(codec.encode(tensors.encode(got)), type=wire.Tensor)
    assert torch.equal(sdk.from_wire(back), t)


def test_listed_complex_results_are_real_imaginary_pairs_both_sides_read():
    t = rotary_table(torch.complex128)
    listed = tensors.to_listed(tensors.encode(t))
    assert listed.data[1][0] == [pytest.approx(t[1, 0].real.item()), pytest.approx(t[1, 0].imag.item())]
    decoded = msgspec.json.decode(msgspec.json.encode(listed), type=wire.Tensor)
    assert torch.equal(sdk.from_wire(decoded), t)
    assert torch.equal(tensors.decode(decoded, where="x", max_elements=100, complex_ok=True), t)


def test_complex_data_without_pairs_is_a_bad_tensor_saying_the_layout():
    value = wire.Tensor(dtype="complex64", shape=[3], data=[1.0, 2.0, 3.0])
    with pytest.raises(SpecError) as err:
        tensors.decode(value, where="inputs", max_elements=100, complex_ok=True)
    assert err.value.code == "bad_tensor" and "[real, imaginary] pair" in err.value.message


LAYERS = {"layers": [{"type": "Linear", "in_features": 2, "out_features": 3}], "dtype": "float32"}
PAIRS = {"dtype": "complex64", "shape": [2, 2], "data": [[[1, 0], [0, 1]], [[1, 1], [2, 2]]]}


@pytest.mark.parametrize("body, where", [
    ({"model": LAYERS, "inputs": PAIRS, "targets": [0, 1]}, "inputs"),
    ({"model": LAYERS, "inputs": [[1.0, 2.0], [3.0, 4.0]], "targets": {**PAIRS, "shape": [2], "data": [[0, 0], [1, 0]]}},
     "targets"),
    ({"model": {**LAYERS, "weights": {"0.weight": {**PAIRS, "shape": [3, 2], "data": [[[1, 0]] * 2] * 3},
                                      "0.bias": {"dtype": "float32", "shape": [3], "data": [0.0] * 3}}},
      "inputs": [[1.0, 2.0]], "targets": [0]},
     "weights['0.weight']"),
])
def test_complex_values_where_only_real_ones_are_taken_are_a_bad_tensor_not_a_dropped_imaginary_part(body, where):
    """A cast to the model's real dtype would silently drop the imaginary parts."""
    request = msgspec.json.decode(msgspec.json.encode({**body, "loss": "cross_entropy",
                                                       "options": {"numcheck": "off"}}), type=wire.GradientRequest)
    with pytest.raises(SpecError) as err:
        compute(request, EngineConfig())
    assert err.value.code == "bad_tensor" and err.value.message.startswith(where)
    assert "view_as_real" in err.value.message


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("encoding", ["raw", "listed", "b64"])
def test_a_sparse_gradient_travels_as_its_parts_in_every_encoding(layout, encoding):
    """A sparse parameter's gradient (torch.sparse.mm's) is encoded as its parts, raw, as lists or as base64
    (the JSON encodings), and the SDK reads it back in its layout."""
    dense = torch.tensor([[0.0, 1.5, 0.0], [-2.0, 0.0, 0.25]])
    t = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    value = tensors.encode(t)
    value = {"raw": value, "listed": tensors.to_listed(value), "b64": tensors.to_b64(value)}[encoding]
    codec = msgspec.msgpack if encoding == "raw" else msgspec.json
    back = sdk.from_wire(codec.decode(codec.encode(value), type=wire.Tensor))
    assert back.layout == t.layout and torch.equal(back.to_dense(), dense)
