"""gradclient/transfer.py's answer buffers: a large answer's buffer serves a later answer only once nothing of
the earlier one (a view, a tensor decoded from it, the gradient an optimizer holds) is alive."""

from __future__ import annotations

import gc

import msgspec
import torch

from gradclient import tensors
from gradclient.transfer import AnswerBuffers
from gradsvc import wire

SIZE = 2_000_000


def _buffer_of(view: memoryview) -> int:
    return id(view.obj.base)


def test_a_buffer_is_reused_once_no_view_of_its_answer_is_alive():
    buffers = AnswerBuffers()
    first = buffers.view(SIZE)
    held = _buffer_of(first)
    second = buffers.view(SIZE)
    assert _buffer_of(second) != held  # the first answer is alive: another buffer
    del first
    gc.collect()
    third = buffers.view(SIZE)
    assert _buffer_of(third) == held
    assert len(buffers.kept) == AnswerBuffers.KEEP


def test_a_tensor_decoded_from_an_answer_keeps_its_buffer_from_reuse():
    buffers = AnswerBuffers()
    grad = torch.arange(100_000, dtype=torch.float32)
    payload = msgspec.msgpack.encode(wire.GradientResult(
        device="cpu", dtype="float32", parameter_count=0, torch_version="", loss=0.0,
        gradients={"w": tensors.to_wire(grad)}, timings=wire.Timings()))
    view = buffers.view(len(payload))
    view[:] = payload
    held = _buffer_of(view)
    result = msgspec.msgpack.Decoder(tensors.decode_type(wire.GradientResult)).decode(view)
    got = tensors.from_wire(result.gradients["w"])
    del view, result
    gc.collect()
    p = torch.nn.Parameter(torch.zeros(100_000))
    p.grad = got  # as set_grads does: the optimizer's gradient is a view of the answer
    del got
    other = buffers.view(len(payload))
    assert _buffer_of(other) != held  # p.grad still reads the first answer's bytes
    other[:] = b"\xff" * len(payload)
    assert torch.equal(p.grad, grad)
    p.grad = None  # zero_grad()
    del other
    gc.collect()
    assert _buffer_of(buffers.view(len(payload))) == held


def test_a_small_answer_does_not_take_a_much_larger_buffer_and_release_drops_them():
    buffers = AnswerBuffers()
    big = buffers.view(4 * SIZE)
    held = _buffer_of(big)
    del big
    gc.collect()
    assert _buffer_of(buffers.view(SIZE)) != held
    buffers.release()
    assert buffers.kept == []
