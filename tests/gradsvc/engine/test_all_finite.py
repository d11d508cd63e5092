"""tensors.all_finite (min and max of a tensor, one reading pass) says what isfinite(t).all() says."""

from __future__ import annotations

import pytest
import torch

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
