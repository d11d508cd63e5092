"""The numerical check's tolerances and verdicts: what float64 and the step resolve of a difference quotient,
when a tensor (or a direction) passes ("zero", "ratio", "floor") or fails, the returned gradients' tolerance by
dtype and as the forward's arithmetic widens it, and the returned-gradient check (docs/numcheck.md, "The
returned gradients' tolerance")."""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

import torch


def rel(abs_err: float, fd: torch.Tensor, ad: torch.Tensor) -> float:
    scale = max(float(fd.abs().max()) if fd.numel() else 0.0, float(ad.abs().max()) if ad.numel() else 0.0, 1e-12)
    return abs_err / scale


# An error below this many float64 roundings of the loss, divided by the step, is the noise floor of
# the difference quotient itself, not a wrong gradient (directional checks at large P sit near it).
FLOOR_ROUNDINGS = 8
F64_EPS = 2.220446049250313e-16


# A returned tensor whose every element is under this many roundings (of its dtype) of the model's largest
# gradient element is zero to working precision (attention's key bias: softmax is shift-invariant).
ZERO_ROUNDINGS = 16


# The returned gradients' tolerance by dtype. float16 and bfloat16 get 16 machine epsilons (1.6e-2 and
# 0.125): half-precision gradients of even a small MLP sit 1-2 epsilons from float64's, and more with depth.
RETURNED_TOLERANCE = MappingProxyType({torch.float64: 1e-10, torch.float32: 1e-4})
HALF_EPSILONS = 16

# TF32 (options.math_mode "tf32" on a CUDA device that has it): convolutions and matmuls read their float32
# operands rounded to a 10-bit mantissa (float16's), accumulating in float32. A float32 gradient that went
# through it is judged as float16's are: HALF_EPSILONS of that mantissa (1.6e-2).
TF32_EPS = 2.0 ** -10


def returned_tolerance(dtype: torch.dtype, math_mode: str = "ieee") -> float:
    """The returned gradients' tolerance at `dtype`, under the float32 math that ran (`math_mode`)."""
    if math_mode == "tf32" and dtype == torch.float32:
        return HALF_EPSILONS * TF32_EPS
    return RETURNED_TOLERANCE.get(dtype, HALF_EPSILONS * torch.finfo(dtype).eps)


def matmul_unit(dtype: torch.dtype, math_mode: str = "ieee") -> float:
    """The rounding unit of a convolution's or a matmul's operands at `dtype` under `math_mode`: TF32's where
    it ran on float32 values, else the dtype's own."""
    return TF32_EPS if math_mode == "tf32" and dtype == torch.float32 else torch.finfo(dtype).eps


# The widened tolerance: this many times the error one simulated rounding of every value moved the gradient
# by (docs/numcheck.md): float32's own error reached 8.8x it over torchvision's classification models (one draw
# of the simulation against the real accumulation order). Never past ARITHMETIC_MAX: a gradient 1.5x or
# sign-flipped still fails (or, where the arithmetic resolves it no better, is not judged).
ARITHMETIC_SAFETY = 16
ARITHMETIC_MAX = 0.25


def arithmetic_tolerances(dtype: torch.dtype, grads: dict[str, torch.Tensor],
                          rounded: dict[str, torch.Tensor | None], math_mode: str = "ieee") -> dict[str, float]:
    """Each tensor's returned-gradient tolerance at `dtype`: the dtype's (RETURNED_TOLERANCE), widened to
    ARITHMETIC_SAFETY x the relative error of `rounded` (the float64 gradient of the same forward with every
    value rounded at `dtype`, as check.py simulates it) where that is larger: a loss large beside its
    gradient (values that cancel) or long reductions lose that much to the dtype's arithmetic. A tensor
    whose gradient is zero to `dtype`'s working precision keeps the dtype's (it is judged "zero")."""
    base = returned_tolerance(dtype)
    scale = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
    zero = ZERO_ROUNDINGS * torch.finfo(dtype).eps * scale
    out = {}
    for name, g in grads.items():
        r = rounded.get(name)
        if r is None or not g.numel() or float(g.abs().max()) <= zero:
            out[name] = base
            continue
        err = float((r.detach() - g).abs().max())
        out[name] = max(base, min(ARITHMETIC_MAX, ARITHMETIC_SAFETY * rel(err, r.detach(), g)))
    return out


# A tensor's tolerance where elements within rounding's reach of a kink were put on the other branch
# (near_kinks.py): this many times the relative distance that moved its float64 gradient. One draw of float32's
# rounding flips some of those elements, not all: the flips' distance bounds it, the margin allows for the rest.
KINK_MARGIN = 2


def kink_tolerances(dtype: torch.dtype, tolerances: dict[str, float], grads: dict[str, torch.Tensor],
                    flipped: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """`tolerances` (arithmetic_tolerances) widened to KINK_MARGIN x each tensor's relative distance between
    `flipped` (float64's gradient with the elements near a kink on their other branch) and float64's own, never
    past ARITHMETIC_MAX; a tensor zero to `dtype`'s working precision keeps its own."""
    scale = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
    zero = ZERO_ROUNDINGS * torch.finfo(dtype).eps * scale
    out = dict(tolerances)
    for name, g in grads.items():
        f = flipped.get(name)
        if f is None or not g.numel() or float(g.abs().max()) <= zero:
            continue
        err = float((f.detach() - g).abs().max())
        out[name] = max(out[name], min(ARITHMETIC_MAX, KINK_MARGIN * rel(err, f.detach(), g)))
    return out


class Returned(NamedTuple):
    max_rel_error: float
    per_parameter: dict[str, float]
    tolerance: float
    floor: float
    passed: bool
    judged: dict[str, str]
    unresolved: tuple[str, ...] = ()  # tensors the dtype's arithmetic does not resolve (verdict "unresolved")


def verdict(size: float, abs_err: float, rel: float, tolerance: float, atol: float, zero: float) -> str:
    """How a tensor (or a direction) passes: every value under `zero`, what the arithmetic resolves ("zero":
    nothing to be relative to), its error within the tolerance of its own scale ("ratio"), its error
    within atol ("floor": small beside the model's gradient)."""
    if size <= zero:
        return "zero"
    if rel <= tolerance:
        return "ratio"
    return "floor" if abs_err <= atol else "failed"


def returned_check(returned: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                   returned_dtype: torch.dtype, along: list[tuple[float, float, float]] = (),
                   tolerance: float | None = None, tolerances: dict[str, float] | None = None,
                   math_mode: str = "ieee") -> Returned:
    """`returned` (what the caller gets) against `reference` (float64 autograd, full batch, same point).

    A tensor passes when its relative error is within the dtype's tolerance, or when its absolute error
    is under tolerance x the largest reference element of the whole model (`floor`): a gradient that
    cancels to ~0 (a bias before BatchNorm) has no scale of its own to be relative to. `along` holds
    (returned . u, reference . u, sum |reference * u|) per direction of a directional check; a direction
    passes within tolerance, or under tolerance x that sum of terms. `tolerance`: another than the dtype's
    (the returned quantities checked against finite differences, quantities.py); `tolerances`: one per
    tensor (arithmetic_tolerances), the largest of them along directions and as the reported tolerance;
    `math_mode`: the float32 math that ran (returned_tolerance)."""
    tolerance = returned_tolerance(returned_dtype, math_mode) if tolerance is None else tolerance
    tolerances = tolerances or {}
    tolerance = max([tolerance, *tolerances.values()])
    scale = max((float(r.abs().max()) for r in reference.values() if r.numel()), default=0.0)
    floor = tolerance * scale
    zero = ZERO_ROUNDINGS * torch.finfo(returned_dtype).eps * scale  # the returned dtype's rounding of the scale
    per: dict[str, float] = {}
    judged: dict[str, str] = {}
    passed = True
    worst = 0.0
    for name, ref in reference.items():
        got = returned[name].detach().to(ref.device, torch.float64)
        abs_err = float((got - ref).abs().max()) if ref.numel() else 0.0
        per[name] = rel(abs_err, got, ref)
        size = max(float(got.abs().max()), float(ref.abs().max())) if ref.numel() else 0.0
        own = tolerances.get(name, tolerance)
        judged[name] = verdict(size, abs_err, per[name], own, own * scale, zero)
        if judged[name] == "failed" and tolerances.get(name, 0.0) >= ARITHMETIC_MAX:
            # rounding every value at the dtype moves this gradient by more than the ceiling allows for: the
            # dtype's own arithmetic cannot tell a wrong gradient from its rounding here, so it is not judged
            judged[name] = "unresolved"
        passed = passed and judged[name] != "failed"
        if judged[name] in ("ratio", "failed"):  # float32 noise on a zero gradient is no error ratio
            worst = max(worst, per[name])
    unresolved = tuple(n for n, v in judged.items() if v == "unresolved")
    for got_u, ref_u, terms in along:
        abs_err = abs(got_u - ref_u)
        rel_u = abs_err / max(abs(got_u), abs(ref_u), 1e-12)
        along_u = verdict(max(abs(got_u), abs(ref_u)), abs_err, rel_u, tolerance, tolerance * terms,
                          ZERO_ROUNDINGS * torch.finfo(returned_dtype).eps * terms)
        if along_u in ("ratio", "failed"):
            worst = max(worst, rel_u)
        # a direction sums every tensor's terms: with one the arithmetic does not resolve, it cannot fail
        # on the others' account (each of them is judged element by element above)
        passed = passed and (along_u != "failed" or bool(unresolved))
    return Returned(worst, per, tolerance, floor, passed, judged, unresolved)
