"""Checks of the returned quantities other than the gradients (Numcheck.quantities), each its own way:

- `hvp`: central differences of float64 autograd gradients along the vector, against H v as returned.
- `input_gradient`: central differences of the float64 loss along a random unit direction of the input,
  against the returned input gradient . direction.
- `per_sample`: the per-example gradients summed (sum losses) or averaged (mean losses) against the
  batch gradient as returned: the identity Opacus and BackPACK users rely on.
- `per_loss`: each loss's gradient as returned against that loss's own float64 autograd gradient.

Tensors are compared by numcheck's rule (relative to the tensor's scale, or under tolerance x the largest
element of the reference: a tensor small beside the rest is not judged by its own noise).
"""

from __future__ import annotations

from typing import Callable

import torch

from gradsvc.wire import QuantityCheck

from .numcheck import F64_EPS, FLOOR_ROUNDINGS, _verdict, returned_check


def _tensors(how: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tolerance: float) -> QuantityCheck:
    """numcheck.returned_check's rule at `tolerance`, zero judged at the rounding of `got`'s dtype."""
    dtype = next(iter(got.values())).dtype if got else torch.float64
    r = returned_check(got, want, dtype if dtype.is_floating_point else torch.float64, tolerance=tolerance)
    return QuantityCheck(how=how, max_rel_error=r.max_rel_error, tolerance=tolerance, passed=r.passed)


def per_loss(per_term: dict[str, dict[str, torch.Tensor]], reference: dict[str, dict[str, torch.Tensor]],
             tolerance: float) -> QuantityCheck:
    """Each loss's returned gradients against its own float64 autograd gradients (the worst loss counts)."""
    checks = [_tensors("", per_term[t], reference[t], tolerance) for t in per_term]
    return QuantityCheck(how="each loss's gradients against its own float64 autograd gradients",
                         max_rel_error=max(c.max_rel_error for c in checks), tolerance=tolerance,
                         passed=all(c.passed for c in checks))


def per_sample(summed: dict[str, torch.Tensor], returned: dict[str, torch.Tensor], tolerance: float,
               how: str) -> QuantityCheck:
    return _tensors(how, summed, {n: g.detach().to(torch.float64) for n, g in returned.items()}, tolerance)


def hvp(params: dict[str, torch.Tensor], loss_fn: Callable[[], torch.Tensor], vector: dict[str, torch.Tensor],
        returned: dict[str, torch.Tensor], eps: float, tolerance: float) -> QuantityCheck:
    """(g(p + eps v) - g(p - eps v)) / 2 eps in float64, against the returned H v."""
    saved = {n: p.detach().clone() for n, p in params.items()}
    v = {n: vector[n].detach().to(p.device, torch.float64) for n, p in params.items()}
    grads = []
    for sign in (1.0, -1.0):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n]).add_(v[n], alpha=sign * eps)
        grads.append(torch.autograd.grad(loss_fn(), list(params.values()), materialize_grads=True))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
    fd = {n: (a - b) / (2 * eps) for n, a, b in zip(params, grads[0], grads[1])}
    return _tensors("central differences of float64 gradients along the vector, against H v",
                    {n: returned[n] for n in params}, fd, tolerance)


def input_gradient(loss_at: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, returned: torch.Tensor,
                   eps: float, tolerance: float, seed: int) -> QuantityCheck:
    """(L(x + eps u) - L(x - eps u)) / 2 eps in float64 along a random unit direction u of the input,
    against returned . u; an error under tolerance x sum |returned * u| (or the loss's rounding) passes."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)
    u /= max(float(u.norm()), 1e-300)
    with torch.no_grad():
        plus, minus = float(loss_at(x + eps * u)), float(loss_at(x - eps * u))
    fd = (plus - minus) / (2 * eps)
    g = returned.detach().to(x.device, torch.float64)
    ad = float((g * u).sum())
    abs_err = abs(fd - ad)
    rel = abs_err / max(abs(fd), abs(ad), 1e-12)
    atol = max(FLOOR_ROUNDINGS * F64_EPS * max(abs(plus), abs(minus), 1e-300) / eps, tolerance * float((g * u).abs().sum()))
    verdict = _verdict(max(abs(fd), abs(ad)), abs_err, rel, tolerance, atol,
                       FLOOR_ROUNDINGS * F64_EPS * max(abs(plus), abs(minus), 1e-300) / eps)
    return QuantityCheck(how="central differences of the float64 loss along a random direction of the input, "
                             "against input_gradient . direction", max_rel_error=0.0 if verdict == "zero" else rel,
                         tolerance=tolerance, passed=verdict != "failed")
