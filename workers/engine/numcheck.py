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


# An error below this many float64 roundings of the loss, divided by the step, is the noise floor of
# the difference quotient itself, not a wrong gradient (directional checks at large P sit near it).
FLOOR_ROUNDINGS = 8
F64_EPS = 2.220446049250313e-16


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
    (float64 leaves, perturbed in place and restored). A tensor (or direction) passes when its
    relative error is within `tolerance` or its absolute error is under the rounding floor."""
    gen = torch.Generator().manual_seed(seed)
    per: dict[str, ParameterCheck] = {}
    evaluations = 0
    worst_abs = worst_rel = worst_floor = 0.0
    passed = True

    def loss_at() -> float:
        nonlocal evaluations
        evaluations += 1
        return float(loss_fn())

    def judge(abs_err: float, rel: float, loss_scale: float) -> None:
        nonlocal worst_abs, worst_rel, worst_floor, passed
        floor = FLOOR_ROUNDINGS * F64_EPS * max(loss_scale, 1e-300) / eps
        worst_abs, worst_rel, worst_floor = max(worst_abs, abs_err), max(worst_rel, rel), max(worst_floor, floor)
        passed = passed and (rel <= tolerance or abs_err <= floor)

    with torch.no_grad():
        if mode == "directional":
            total = 2 * directions
            count = sum(p.numel() for p in params.values())
            scale = 1.0 / math.sqrt(max(count, 1))
            for k in range(directions):
                # Random signs over all parameters: a unit direction whose norm is known exactly, and
                # ~7x cheaper to draw than a Gaussian one at a million parameters.
                us = {name: (torch.randint(0, 2, p.shape, generator=gen, dtype=torch.int8).to(p.device, torch.float64)
                             .mul_(2).sub_(1).mul_(scale)) for name, p in params.items()}
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
                judge(abs_err, abs_err / max(abs(fd), abs(ad), 1e-12), max(abs(plus), abs(minus)))
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
                loss_scale = 0.0
                for j, i in enumerate(idx.tolist()):
                    orig = float(flat[i])
                    flat[i] = orig + eps
                    plus = loss_at()
                    flat[i] = orig - eps
                    minus = loss_at()
                    flat[i] = orig
                    fd[j] = (plus - minus) / (2 * eps)
                    loss_scale = max(loss_scale, abs(plus), abs(minus))
                    done += 2
                    if progress and done % 64 == 0:
                        progress("numcheck", done, total)
                ad = grads[name].detach().reshape(-1)[idx].to("cpu", torch.float64)
                abs_err = float((fd - ad).abs().max()) if len(idx) else 0.0
                rel = _rel(abs_err, fd, ad) if len(idx) else 0.0
                per[name] = ParameterCheck(max_abs_error=abs_err, max_rel_error=rel, checked=len(idx))
                judge(abs_err, rel, loss_scale)
    return Numcheck(
        mode=mode,
        eps=eps,
        dtype="float64",
        evaluations=evaluations,
        max_abs_error=worst_abs,
        max_rel_error=worst_rel,
        passed=passed,
        tolerance=tolerance,
        per_parameter=per,
        rounding_floor=worst_floor,
    )
