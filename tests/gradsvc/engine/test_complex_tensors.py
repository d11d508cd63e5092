"""complex64 and complex128 on the wire: raw interleaved little-endian bytes (MessagePack data, JSON b64) and
nested [real, imaginary] pairs, decoded by the engine and the SDK alike; results come back the same way."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradclient import tensors as sdk
from gradsvc import wire
from gradsvc.engine import tensors
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
    got = tensors.decode(sent, where="x", max_elements=100)
    assert got.dtype == dtype and torch.equal(got, t)
    back = codec.decode(codec.encode(tensors.encode(got)), type=wire.Tensor)
    assert torch.equal(sdk.from_wire(back), t)


def test_listed_complex_results_are_real_imaginary_pairs_both_sides_read():
    t = rotary_table(torch.complex128)
    listed = tensors.to_listed(tensors.encode(t))
    assert listed.data[1][0] == [pytest.approx(t[1, 0].real.item()), pytest.approx(t[1, 0].imag.item())]
    decoded = msgspec.json.decode(msgspec.json.encode(listed), type=wire.Tensor)
    assert torch.equal(sdk.from_wire(decoded), t)
    assert torch.equal(tensors.decode(decoded, where="x", max_elements=100), t)


def test_complex_data_without_pairs_is_a_bad_tensor_saying_the_layout():
    value = wire.Tensor(dtype="complex64", shape=[3], data=[1.0, 2.0, 3.0])
    with pytest.raises(SpecError) as err:
        tensors.decode(value, where="inputs", max_elements=100)
    assert err.value.code == "bad_tensor" and "[real, imaginary] pair" in err.value.message
