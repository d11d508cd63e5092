"""Custom autograd Functions the tests send as users write them: a straight-through estimator (its backward not its
forward's derivative) and a product with its right backward written by hand."""

from __future__ import annotations

import torch


class RoundStraightThrough(torch.autograd.Function):
    """A straight-through estimator: round forward, identity backward inside [-1, 1]."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1).to(g.dtype)


class Scaled(torch.autograd.Function):
    """x * w * k with its (right) backward written by hand, a number among its arguments."""

    @staticmethod
    def forward(ctx, x, w, k):
        ctx.save_for_backward(x, w)
        ctx.k = k
        return x * w * k

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w * ctx.k, (g * x * ctx.k).sum(0), None
