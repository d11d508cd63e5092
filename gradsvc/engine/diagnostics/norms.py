"""Gradient norms (global, per parameter, per module) and the statistics of the examples' gradients:
BackPACK's Variance and SumGradSquared, and the gradient noise scale of McCandlish et al. (2018)."""

from __future__ import annotations

import torch

from gradsvc.wire import NoiseScale, Norms

from .. import tensors


def module_path(parameter: str) -> str:
    """The module that owns a parameter: its state_dict name without the last part ("0" for a layer
    spec's "0.weight", "" for a parameter of the root module)."""
    return parameter.rpartition(".")[0]


def norms(grads: dict[str, torch.Tensor]) -> Norms:
    """L2 norms of the batch gradient, in float64 whatever the gradients' dtype."""
    squares = {n: float(torch.linalg.vector_norm(g.detach().to(torch.float64)) ** 2) for n, g in grads.items()}
    modules: dict[str, float] = {}
    for name, sq in squares.items():
        path = module_path(name)
        modules[path] = modules.get(path, 0.0) + sq
    return Norms(global_=sum(squares.values()) ** 0.5, parameters={n: sq ** 0.5 for n, sq in squares.items()},
                 modules={p: sq ** 0.5 for p, sq in modules.items()})


def _scaled(per_example: dict[str, torch.Tensor], reduction: str) -> dict[str, torch.Tensor]:
    """Each example's share of the batch gradient, as BackPACK's BatchGrad gives it: the loss's gradient
    divided by N under a mean reduction, itself under a sum."""
    n = next(iter(per_example.values())).shape[0]
    return {k: g.to(torch.float64) / (n if reduction == "mean" else 1) for k, g in per_example.items()}


def second_moment(per_example: dict[str, torch.Tensor], reduction: str) -> dict[str, torch.Tensor]:
    """BackPACK's SumGradSquared: sum over the examples of each one's share of the gradient, squared."""
    return {k: (b ** 2).sum(0) for k, b in _scaled(per_example, reduction).items()}


def variance(per_example: dict[str, torch.Tensor], reduction: str) -> dict[str, torch.Tensor]:
    """BackPACK's Variance: SumGradSquared / N - (gradient / N)^2, from the same shares."""
    out = {}
    for k, b in _scaled(per_example, reduction).items():
        n = b.shape[0]
        out[k] = (b ** 2).sum(0) / n - (b.sum(0) / n) ** 2
    return out


def noise_scale(per_example: dict[str, torch.Tensor]) -> NoiseScale:
    """B_simple from the examples' own loss gradients g_n (not scaled by the reduction): with g their mean,
    S = sum |g_n - g|^2 / (N - 1), |G|^2 = |g|^2 - S / N, B_simple = S / |G|^2."""
    n = next(iter(per_example.values())).shape[0]
    if n < 2:
        return NoiseScale(b_simple=None, trace_covariance=None, gradient_norm_squared=None,
                          reason=f"the batch has {n} example; the noise scale needs at least 2")
    spread, mean_sq = 0.0, 0.0
    for g in per_example.values():
        g = g.reshape(n, -1).to(torch.float64)  # (batch, elements)
        mean = g.mean(0)
        spread += float(((g - mean) ** 2).sum())
        mean_sq += float((mean ** 2).sum())
    s = spread / (n - 1)
    g2 = mean_sq - s / n
    if g2 <= 0:
        return NoiseScale(b_simple=None, trace_covariance=s, gradient_norm_squared=g2,
                          reason=f"|G|^2 = |g|^2 - S/N = {g2:.6g} is not positive: the batch's gradient is within "
                                 "its noise; use a larger batch")
    return NoiseScale(b_simple=s / g2, trace_covariance=s, gradient_norm_squared=g2)


def encoded(per_parameter: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """Per-parameter tensors in the model's dtype, encoded for the wire."""
    return {k: tensors.encode(v.to(dtype)) for k, v in per_parameter.items()}
