"""Kinks: where a central difference straddles a point where the loss is not differentiable (a ReLU at 0, a
max-pool tie), an offending element (or direction) is differenced again at smaller steps, then judged by its
one-sided differences (docs/numcheck.md, "Kinks")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .tally import Tally


# Smaller steps an offending difference is retried at, as fractions of eps: a kink straddled at eps is
# usually not at eps / 10, and float64 still resolves a difference quotient at eps / 100 for losses near 1.
SETTLE_STEPS = (0.1, 0.01)
# A kink keeps its one-sided differences apart however small the step; a smooth function's gap shrinks in
# proportion to the step. Apart by more than this many times the proportional gap: a kink.
KINK_GAP = 4.0


def settle(losses_at: Callable[[float], tuple[float, float]], ad: float, plus: float, minus: float,
           allowed: float, tally: Tally, several: bool = False) -> tuple[str, float]:
    """An offending central difference (losses `plus`, `minus` at +-eps) settled: ("resolved", fd) where a
    smaller step brings it within `allowed` of `ad`; ("kink", fd) where the one-sided differences
    (f(x+h)-f(x))/h and (f(x)-f(x-h))/h stay apart at the smallest step, more than a smooth function's
    curvature keeps them, with `ad` between them (a subgradient); ("unsettled", fd) where the central difference
    itself still moves by more than `allowed` between the two smallest steps (a smooth function's settles in
    proportion to the step squared): the loss curves too sharply there for float64 differences to measure a
    derivative (a BatchNorm over two values), so nothing is judged; else ("failed", fd): a wrong gradient.
    `several`: the perturbation may cross several kinks at once (a direction moves every parameter), some
    convex and some concave along it (a ReLU at exactly 0 read through a negative weight): autograd's value, a
    subgradient of each, need not lie between the summed one-sided slopes, so slopes apart at every step (a kink
    at the point itself, not beside it) are a kink wherever `ad` lies."""
    eps = tally.eps
    base = tally.base_loss()
    gap0 = abs((plus - base) - (base - minus)) / eps
    fd = (plus - minus) / (2 * eps)
    right = left = fd
    step = eps
    at_every_step = True
    quotients = []  # (fd, what float64 resolves of it) at each smaller step
    for fraction in SETTLE_STEPS:
        step = eps * fraction
        plus, minus = losses_at(step)
        fd = (plus - minus) / (2 * step)
        quotients.append((fd, tally.rounding(max(abs(plus), abs(minus))) * eps / step))
        if abs(fd - ad) <= allowed + quotients[-1][1]:
            return "resolved", fd
        right, left = (plus - base) / step, (base - minus) / step
        rounding = 2 * tally.rounding(max(abs(plus), abs(minus), abs(base))) * eps / step
        apart = abs(right - left) > KINK_GAP * gap0 * step / eps + rounding
        at_every_step = at_every_step and abs(right - left) > gap0 / KINK_GAP + rounding  # the gap kept its size
    between = min(right, left) - allowed - rounding <= ad <= max(right, left) + allowed + rounding
    if apart and (between or several and at_every_step):
        return "kink", fd
    (coarse, coarse_rounding), (fine, fine_rounding) = quotients[-2:]
    if abs(fine - coarse) > allowed + coarse_rounding + fine_rounding:
        return "unsettled", fd  # still moving at the smallest step: no derivative to hold `ad` against
    return "failed", fd
