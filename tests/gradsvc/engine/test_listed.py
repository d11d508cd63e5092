"""A result tensor written as nested lists for a JSON client (tensors.to_listed) holds exactly what torch's tolist
gives, whichever way it is read: by Python itself for the dtypes it knows, by torch for the others."""

from __future__ import annotations

import pytest
import torch

from gradsvc.engine import tensors
from gradsvc.wire import Tensor

DTYPES = [torch.float64, torch.float32, torch.int64, torch.int32, torch.uint8, torch.bool, torch.float16,
          torch.bfloat16]
SHAPES = [(), (1,), (5,), (3, 4), (2, 3, 4), (1, 1, 1, 1), (0,), (3, 0), (0, 2)]


def sample(dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    torch.manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape).to(dtype)
    return (torch.randn(shape) * 100).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_lists_equal_torchs_tolist(dtype, shape):
    t = sample(dtype, shape)
    listed = tensors.to_listed(tensors.encode(t))
    assert listed.data == t.tolist() and type(listed.data) is type(t.tolist())
    assert listed.shape == list(shape) and listed.dtype == tensors.DTYPE_NAMES[dtype]


def test_special_values_and_a_view_at_an_odd_offset():
    t = torch.tensor([[float("nan"), float("inf")], [-0.0, 1e-45]], dtype=torch.float32)
    body = bytearray(b"x") + t.numpy().tobytes()  # as a decoded body's view may sit: not 4-byte aligned
    listed = tensors.to_listed(Tensor(dtype="float32", shape=[2, 2], data=memoryview(body)[1:]))
    want = t.tolist()
    assert str(listed.data) == str(want)  # nan != nan: compared as written
    assert [[str(v) for v in row] for row in listed.data] == [["nan", "inf"], ["-0.0", str(want[1][1])]]


def test_bytes_that_disagree_with_the_shape_are_refused_as_before():
    with pytest.raises(Exception) as caught:
        tensors.to_listed(Tensor(dtype="float64", shape=[3], data=bytes(16)))
    assert getattr(caught.value, "code", None) == "bad_tensor"
