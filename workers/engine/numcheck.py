"""The numerical check: central finite differences in float64 against autograd.

Modes: `exact` perturbs every element (2P evaluations), `sampled` k random elements per tensor,
`directional` m random unit directions over all parameters (gradcheck's fast mode: 2m evaluations,
compared with grad . u). A tensor's error is max|fd - ad| / max(max|fd|, max|ad|, 1e-12).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from gradsvc.wire import Numcheck, ParameterCheck

Progress = Callable[[str, int, int], None]


def _rel(abs_err: float, fd: torch.Tensor, ad: torch.Tensor) -> float:
    scale = max(float(fd.abs().max()) if fd.numel() else 0.0, float(ad.abs().max()) if ad.numel() else 0.0, 1e-12)
    return abs_err / scale


def run(
    mode: str,
    params: dict[str, torch.Tensor],
    loss_fn: Callable[[], torch.Tensor],
    grads: dict[str, torch.Tensor],
    *,
    eps: float,
    tolerance: float,
    samples: int,
    directions: int,
    seed: int,
    progress: Progress | None = None,
) -> Numcheck:
    """Checks `grads` (float64 autograd) against finite differences of `loss_fn` over `params`
    (float64 leaves, perturbed in place and restored)."""
    gen = torch.Generator().manual_seed(seed)
    per: dict[str, ParameterCheck] = {}
    evaluations = 0
    worst_abs = worst_rel = 0.0

    def loss_at() -> float:
        nonlocal evaluations
        evaluations += 1
        return float(loss_fn())

    with torch.no_grad():
        if mode == "directional":
            total = 2 * directions
            for k in range(directions):
                us = {name: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device) for name, p in params.items()}
                norm = math.sqrt(sum(float((u * u).sum()) for u in us.values())) or 1.0
                for u in us.values():
                    u /= norm
                for name, p in params.items():
                    p.add_(us[name], alpha=eps)
                plus = loss_at()
                for name, p in params.items():
                    p.add_(us[name], alpha=-2 * eps)
                minus = loss_at()
                for name, p in params.items():
                    p.add_(us[name], alpha=eps)
                fd = (plus - minus) / (2 * eps)
                ad = sum(float((grads[name] * us[name]).sum()) for name in params)
                abs_err = abs(fd - ad)
                rel = abs_err / max(abs(fd), abs(ad), 1e-12)
                worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel)
                if progress:
                    progress("numcheck", 2 * (k + 1), total)
        else:
            picks = {}
            for name, p in params.items():
                if mode == "exact" or p.numel() <= samples:
                    picks[name] = torch.arange(p.numel())
                else:
                    picks[name] = torch.randperm(p.numel(), generator=gen)[:samples].sort().values
            total = 2 * sum(len(ix) for ix in picks.values())
            done = 0
            for name, p in params.items():
                flat = p.view(-1)
                idx = picks[name]
                fd = torch.empty(len(idx), dtype=torch.float64)
                for j, i in enumerate(idx.tolist()):
                    orig = float(flat[i])
                    flat[i] = orig + eps
                    plus = loss_at()
                    flat[i] = orig - eps
                    minus = loss_at()
                    flat[i] = orig
                    fd[j] = (plus - minus) / (2 * eps)
                    done += 2
                    if progress and done % 64 == 0:
                        progress("numcheck", done, total)
                ad = grads[name].detach().reshape(-1)[idx].to("cpu", torch.float64)
                abs_err = float((fd - ad).abs().max()) if len(idx) else 0.0
                rel = _rel(abs_err, fd, ad) if len(idx) else 0.0
                per[name] = ParameterCheck(max_abs_error=abs_err, max_rel_error=rel, checked=len(idx))
                worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel)
    return Numcheck(
        mode=mode,
        eps=eps,
        dtype="float64",
        evaluations=evaluations,
        max_abs_error=worst_abs,
        max_rel_error=worst_rel,
        passed=worst_rel <= tolerance,
        tolerance=tolerance,
        per_parameter=per,
    )
