"""Wire tensors in the SDK: every dtype round-trips, large tensors are views (no copies), numpy without torch."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from gradclient import tensors
from gradsvc import wire

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.bool]


def _sample(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 10
    return (x > 0) if dtype == torch.bool else x.to(dtype)


def _round_trip(value, fmt: str):
    t = tensors.to_wire(value, fmt)
    raw = msgspec.msgpack.encode(t) if fmt == "msgpack" else msgspec.json.encode(t)
    kind = msgspec.msgpack if fmt == "msgpack" else msgspec.json
    return kind.Decoder(tensors.decode_type(wire.Tensor)).decode(bytearray(raw))


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(dtype, fmt):
    x = _sample(dtype)
    back = tensors.from_wire(_round_trip(x, fmt))
    assert back.dtype == dtype and back.shape == x.shape and torch.equal(back, x)


def test_sending_hands_the_encoder_a_view_of_the_tensor_memory():
    x = torch.randn(1000)
    t = tensors.to_wire(x)
    assert isinstance(t.data, memoryview) and len(t.data) == 4000
    x[0] = 42.0  # the view sees it: nothing was copied before encoding
    assert np.frombuffer(t.data, dtype="<f4")[0] == 42.0


def _decode_at(payload: bytes, misalign: int):
    """Decodes `payload` from a buffer placed so that its last 16 KiB start `misalign` bytes past a 64-byte
    boundary (the float32 data sits at the end of the message)."""
    big = bytearray(len(payload) + 128)
    base = np.frombuffer(big, dtype=np.uint8).ctypes.data
    pad = (-(base + len(payload) - 4 * 4096) + misalign) % 64
    big[pad:pad + len(payload)] = payload
    view = memoryview(big)[pad:pad + len(payload)]
    decoded = msgspec.msgpack.Decoder(tensors.decode_type(wire.Tensor)).decode(view)
    return tensors.from_wire(decoded), base + pad + len(payload) - 4 * 4096


def test_a_received_aligned_tensor_is_a_writable_view_into_the_body():
    payload = msgspec.msgpack.encode(tensors.to_wire(torch.arange(4096, dtype=torch.float32)))
    got, address = _decode_at(payload, misalign=0)
    assert got.data_ptr() == address  # the body's own bytes: no copy
    assert torch.equal(got, torch.arange(4096, dtype=torch.float32))
    got[0] = 7.0  # writable, no read-only warning


@pytest.mark.parametrize("misalign", [1, 2, 3])
def test_a_received_misaligned_tensor_is_moved_back_onto_its_header_within_the_body(misalign):
    """Not copied into fresh memory: moved `misalign` bytes back, over its own "data" key and bin header."""
    payload = msgspec.msgpack.encode(tensors.to_wire(torch.arange(4096, dtype=torch.float32)))
    got, address = _decode_at(payload, misalign=misalign)
    assert got.data_ptr() == address - misalign and got.data_ptr() % 4 == 0
    assert torch.equal(got, torch.arange(4096, dtype=torch.float32))


def test_misaligned_tensors_side_by_side_each_move_within_their_own_bytes():
    """Every tensor of a result, of every size class of bin header and of 8-byte dtypes too, comes back equal
    after the others moved: none reaches into another's bytes."""
    decoder = msgspec.msgpack.Decoder(tensors.decode_type(wire.GradientResult))
    for dtype in (torch.float16, torch.float32, torch.float64, torch.int64):
        sent = {f"p{i}": (torch.randn(n, generator=torch.Generator().manual_seed(i)) * 9).to(dtype)
                for i, n in enumerate([1, 3, 100, 300, 20000, 70001])}
        result = wire.GradientResult(device="cpu", dtype="float32", parameter_count=0, torch_version="", loss=0.0,
                                     gradients={k: tensors.to_wire(v) for k, v in sent.items()}, timings=wire.Timings())
        body = memoryview(np.frombuffer(bytearray(msgspec.msgpack.encode(result)), dtype=np.uint8).copy())
        got = {k: tensors.from_wire(v) for k, v in decoder.decode(body).gradients.items()}
        for k, v in sent.items():
            assert torch.equal(got[k], v) and got[k].data_ptr() % v.element_size() == 0, (dtype, k)


def test_a_misaligned_tensor_in_a_read_only_body_is_copied_once_into_aligned_memory():
    payload = msgspec.msgpack.encode(tensors.to_wire(torch.arange(4096, dtype=torch.float32)))
    decoded = msgspec.msgpack.Decoder(tensors.decode_type(wire.Tensor)).decode(payload)  # bytes: read-only views
    got = tensors.from_wire(decoded)
    assert got.data_ptr() % 4 == 0 and torch.equal(got, torch.arange(4096, dtype=torch.float32))
    got[0] = 7.0  # its own memory: the bytes object is never written
    assert msgspec.msgpack.decode(payload, type=wire.Tensor).data == tensors.to_wire(
        torch.arange(4096, dtype=torch.float32)).data.tobytes()


def test_without_torch_tensors_come_back_as_numpy(monkeypatch):
    monkeypatch.setattr(tensors, "torch", None)
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    back = tensors.from_wire(_round_trip(a, "msgpack"))
    assert isinstance(back, np.ndarray) and back.dtype == np.float64 and np.array_equal(back, a)
    bf16 = wire.Tensor(dtype="bfloat16", shape=[2], data=memoryview(bytearray(b"\xc0\x3f\x10\xc0")))
    assert np.array_equal(tensors.from_wire(bf16), np.array([1.5, -2.25], dtype=np.float32))


def test_decode_type_swaps_bytes_for_memoryview_and_keeps_everything_else():
    result_type = tensors.decode_type(wire.GradientResult)
    fields = {f.name: f.type for f in msgspec.structs.fields(result_type)}
    assert fields["numcheck"] == wire.Numcheck | None and fields["timings"] is wire.Timings
    tensor_type = tensors.decode_type(wire.Tensor)
    assert {f.name: f.type for f in msgspec.structs.fields(tensor_type)}["data"] == list | memoryview | None
