"""The numerical check: central finite differences in float64 against autograd.

Modes: `exact` perturbs every element (2P evaluations), `sampled` k random elements per tensor,
`directional` m random unit directions over all parameters (gradcheck's fast mode: 2m evaluations,
compared with grad . u). A tensor's error is max|fd - ad| / max(max|fd|, max|ad|, 1e-12).

`returned_check` judges the answer itself: the gradients exactly as returned (their dtype, summed over
micro-batches, checkpointed, accumulated over losses) against the float64 autograd reference on the
same batch, by the same ratio, in every mode (and along the directional mode's directions too).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

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


# The returned gradients' tolerance by dtype. float16 and bfloat16 get 16 machine epsilons (1.6e-2 and
# 0.125): half-precision gradients of even a small MLP sit 1-2 epsilons from float64's, and more with depth.
RETURNED_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}
HALF_EPSILONS = 16


def returned_tolerance(dtype: torch.dtype) -> float:
    return RETURNED_TOLERANCE.get(dtype, HALF_EPSILONS * torch.finfo(dtype).eps)


class Returned(NamedTuple):
    max_rel_error: float
    per_parameter: dict[str, float]
    tolerance: float
    floor: float
    passed: bool


def returned_check(returned: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                   returned_dtype: torch.dtype, along: list[tuple[float, float, float]] = ()) -> Returned:
    """`returned` (what the caller gets) against `reference` (float64 autograd, full batch, same point).

    A tensor passes when its relative error is within the dtype's tolerance, or when its absolute error
    is under tolerance x the largest reference element of the whole model (`floor`): a gradient that
    cancels to ~0 (a bias before BatchNorm) has no scale of its own to be relative to. `along` holds
    (returned . u, reference . u, sum |reference * u|) per direction of a directional check; a direction
    passes within tolerance, or under tolerance x that sum of terms."""
    tolerance = returned_tolerance(returned_dtype)
    scale = max((float(r.abs().max()) for r in reference.values() if r.numel()), default=0.0)
    floor = tolerance * scale
    per: dict[str, float] = {}
    passed = True
    for name, ref in reference.items():
        got = returned[name].detach().to(ref.device, torch.float64)
        abs_err = float((got - ref).abs().max()) if ref.numel() else 0.0
        per[name] = _rel(abs_err, got, ref)
        passed = passed and (per[name] <= tolerance or abs_err <= floor)
    worst = max(per.values(), default=0.0)
    for got_u, ref_u, terms in along:
        abs_err = abs(got_u - ref_u)
        rel = abs_err / max(abs(got_u), abs(ref_u), 1e-12)
        worst = max(worst, rel)
        passed = passed and (rel <= tolerance or abs_err <= tolerance * terms)
    return Returned(worst, per, tolerance, floor, passed)


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
    returned: dict[str, torch.Tensor] | None = None,
    returned_dtype: torch.dtype = torch.float64,
) -> Numcheck:
    """Checks `grads` (float64 autograd) against finite differences of `loss_fn` over `params`
    (float64 leaves, perturbed in place and restored). A tensor (or direction) passes when its
    relative error is within `tolerance` or its absolute error is under the rounding floor.
    With `returned` (the gradients the caller gets), those are judged against `grads` too
    (`returned_check`), and `passed` needs both."""
    gen = torch.Generator().manual_seed(seed)
    per: dict[str, ParameterCheck] = {}
    evaluations = 0
    worst_abs = worst_rel = worst_floor = 0.0
    passed = True
    along: list[tuple[float, float, float]] = []  # the returned gradients along each direction

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
            if returned is not None:  # one float64 copy, and sum |reference * u| (|u| is `scale` everywhere)
                returned64 = {n: returned[n].detach().to(p.device, torch.float64).reshape(-1) for n, p in params.items()}
                terms = scale * sum(float(grads[n].abs().sum()) for n in params)
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
                if returned is not None:
                    along.append((sum(float(torch.dot(returned64[n], us[n].reshape(-1))) for n in params), ad, terms))
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
    check = Numcheck(
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
    if returned is None:
        return check
    r = returned_check(returned, grads, returned_dtype, along)
    for name, rel in r.per_parameter.items():
        # Directional mode has no element-wise finite differences: those entries say checked=0.
        per.setdefault(name, ParameterCheck(max_abs_error=0.0, max_rel_error=0.0, checked=0)).returned_max_rel_error = rel
    check.returned_max_rel_error, check.returned_tolerance, check.returned_floor = r.max_rel_error, r.tolerance, r.floor
    check.passed = passed and r.passed
    return check


def unchecked(dtype: torch.dtype) -> Numcheck:
    """What a result says when numcheck is "off": nothing was checked, so nothing passed."""
    return Numcheck(mode="off", eps=0.0, dtype="float64", evaluations=0, max_abs_error=0.0, max_rel_error=0.0,
                    passed=False, tolerance=0.0, per_parameter={}, returned_tolerance=returned_tolerance(dtype))
