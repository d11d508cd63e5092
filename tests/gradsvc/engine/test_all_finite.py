"""tensors.all_finite (min and max of a tensor, one reading pass) says what isfinite(t).all() says."""

from __future__ import annotations

import pytest
import torch

from gradsvc.engine import tensors
from gradsvc.engine.tensors import all_finite

BAD = (float("nan"), float("inf"), -float("inf"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 16, 33, 1000, 100_003])
def test_one_non_finite_element_anywhere_is_found(dtype, n):
    g = torch.Generator().manual_seed(n)
    clean = torch.randn(n, generator=g).to(dtype)
    assert all_finite(clean)
    for pos in {0, n // 2, n - 1}:
        for bad in BAD:
            x = clean.clone()
            x[pos] = bad
            assert not all_finite(x), (dtype, n, pos, bad)
            assert all_finite(x) == bool(torch.isfinite(x).all())


def test_shapes_layouts_and_dtypes_without_non_finite_values():
    x = torch.randn(64, 64)[:, ::2]  # not contiguous
    assert all_finite(x)
    x[3, 5] = float("nan")
    assert not all_finite(x)
    assert all_finite(torch.empty(0)) and all_finite(torch.empty(3, 0, dtype=torch.float64))
    assert all_finite(torch.tensor([1, 2, 3])) and all_finite(torch.tensor([True, False]))
    assert not all_finite(torch.tensor([1 + 1j, complex(float("nan"), 0)]))
    assert all_finite(torch.tensor(2.5)) and not all_finite(torch.tensor(float("inf")))


def test_a_tensor_that_requires_grad_is_read_without_recording_a_graph():
    w = torch.randn(5, requires_grad=True)
    y = w * 2
    assert all_finite(y) and y.grad_fn is not None
    y.sum().backward()  # the check left nothing behind that backward would trip over
    assert torch.equal(w.grad, torch.full((5,), 2.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_fused_check_finds_one_bad_value_among_many_tensors(dtype, bad):
    ts = [torch.randn(7, 5, dtype=dtype), torch.randn(300, dtype=torch.float32), torch.zeros(0, dtype=dtype),
          torch.arange(4), torch.randn(3, 2, dtype=dtype).t()]  # an integer tensor and a non-contiguous one
    assert tensors.fused_all_finite(ts)
    ts[4][1, 2] = bad
    assert not tensors.fused_all_finite(ts)
    assert tensors.all_finite_many(ts) is False  # CPU tensors: the small ones together, the same answer


@pytest.mark.parametrize("where", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_many_cpu_tensors_small_ones_together_and_large_ones_each(where, bad):
    """all_finite_many on a CPU: the small tensors checked in one concatenation per dtype, the large ones each;
    one bad value anywhere (a small float32, a small float64, a large one, a sparse one, a complex one) is found."""
    ts = [torch.randn(7, 5), torch.randn(3, dtype=torch.float64), torch.randn(70_000),
          torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,)),
          torch.randn(3, dtype=torch.complex64), torch.randn(6, 4).t(), torch.arange(5), torch.zeros(0)]
    ts += [torch.full((9,), torch.finfo(torch.float32).max)]  # huge but finite: no overflow to mistake
    assert tensors.all_finite_many(ts) is True
    if where == 3:
        ts[3] = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, bad]), (4,))
    else:
        ts[where].view(-1)[-1] = bad
    assert tensors.all_finite_many(ts) is False


def test_the_fused_check_tells_huge_finite_values_from_infinite_ones():
    huge = torch.full((1000,), torch.finfo(torch.float32).max / 2)  # its L1 norm overflows to inf
    half = torch.full((10,), 60000.0, dtype=torch.float16)
    assert tensors.fused_all_finite([huge, half]) and tensors.all_finite_many([huge, half])
    assert tensors.fused_all_finite([torch.tensor([1 + 2j, 3j])])
    assert not tensors.fused_all_finite([huge, torch.tensor([complex(float("nan"), 0)])])
    assert tensors.all_finite_many([])


def test_host_copies_leave_cpu_tensors_as_they_are():
    named = {"a": torch.randn(3), "b": torch.arange(2)}
    assert tensors.to_host(named) is named
