"""What a check has counted and found so far (`Tally`), shared by the exact and directional modes: the
evaluations, the worst errors, the kinks, whether everything passed; and how it evaluates a perturbed loss,
one at a time or batched (batched.py) until a batched call fails."""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from gradsvc.wire import Numcheck, ParameterCheck

from .batched import BATCH_FAILURES, Batched
from .tolerances import F64_EPS, FLOOR_ROUNDINGS


# Called as the check goes: (phase, done, total); the worker writes it to the job (the wire Progress).
ProgressCallback = Callable[[str, int, int], None]


log = logging.getLogger(__name__)


class Tally:
    """What a check has counted and found so far, shared by `exact` and `directional`: the evaluations, the
    worst absolute and relative errors and rounding floor, whether everything passed; and how it evaluates
    a perturbed loss (one at a time, or `batched` until a batched call fails)."""

    def __init__(self, loss_fn: Callable[[], torch.Tensor], batched: Batched | None, eps: float, tolerance: float,
                 progress: ProgressCallback | None) -> None:
        self.loss_fn, self.batched, self.eps, self.tolerance, self.progress = loss_fn, batched, eps, tolerance, progress
        self.evaluations = 0
        self.worst_abs = self.worst_rel = self.worst_floor = 0.0
        self.passed = True
        self.kinks = 0  # elements (or directions) found straddling a kink, left out of the figures
        self.unsettled = 0  # those whose difference still moved at the smallest step (kinks.settle): left out
        self.judged = 0  # elements (or directions) judged otherwise: compared, found zero or under the floor
        self._base: float | None = None

    def loss_at(self) -> float:
        self.evaluations += 1
        return float(self.loss_fn())

    def base_loss(self) -> float:
        """The loss at the unperturbed parameters, evaluated once (the one-sided differences' middle)."""
        if self._base is None:
            self._base = self.loss_at()
        return self._base

    def losses_at(self, perturbed: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The batched losses of `perturbed`, or None (and no more batching) if the call fails. The caller
        counts the evaluations once a tensor's (or a chunk's) are all in: a failure redoes them all."""
        try:
            out = self.batched.losses(perturbed).detach().to("cpu", torch.float64).reshape(-1)
            rows = next(iter(perturbed.values())).shape[0]
            if out.shape[0] != rows:
                raise RuntimeError(f"{out.shape[0]} losses for {rows} evaluations")
        except BATCH_FAILURES as exc:  # never fail a check because batching failed: the loop is the reference
            log.debug("numcheck: batched evaluation failed, evaluating one loss at a time: %r", exc)
            self.batched = None
            return None
        return out

    def rounding(self, loss_scale: float) -> float:
        """What float64 resolves of a difference quotient of losses of this size, at this step."""
        return FLOOR_ROUNDINGS * F64_EPS * max(loss_scale, 1e-300) / self.eps

    def judge(self, abs_err: float, rel: float, atol: float, verdict: str) -> None:
        self.judged += 1
        self.worst_abs, self.worst_floor = max(self.worst_abs, abs_err), max(self.worst_floor, atol)
        if verdict in ("ratio", "failed"):  # zero: noise over noise; floor: small beside the rest (per parameter)
            self.worst_rel = max(self.worst_rel, rel)
        self.passed = self.passed and verdict != "failed"

    def report(self, done: int, total: int) -> None:
        if self.progress:
            self.progress("numcheck", done, total)

    def summary(self, mode: str, per: dict[str, ParameterCheck], grads: dict[str, torch.Tensor]) -> Numcheck:
        """The Numcheck of what was tallied. A step too small (or too large) for float64 to resolve the
        gradients has its rounding floor over the largest gradient element, so every tensor would read as
        "zero": nothing was checked, and it says so."""
        eps, tolerance, worst_floor = self.eps, self.tolerance, self.worst_floor
        gradient_scale = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
        rounding_only = FLOOR_ROUNDINGS * F64_EPS / eps  # the floor per unit of loss
        unresolved = not math.isfinite(worst_floor) or (gradient_scale > 0 and worst_floor >= gradient_scale
                                                        and worst_floor > tolerance * gradient_scale * 2
                                                        and rounding_only > tolerance)
        only_kinks = self.kinks > 0 and self.judged == 0  # every element or direction taken straddled a kink
        what = "directions" if mode == "directional" else "elements"
        reason = ""
        if self.unsettled and self.passed and not unresolved:
            reason = (f"{self.unsettled} of the {what} taken had central differences still moving at the smallest "
                      f"step tried (eps/100): the loss curves too sharply there for float64 differences to measure "
                      "its derivative (a BatchNorm over a few values does), so they were not judged and the check "
                      "cannot say it passed (passed is null); the rest held. A larger batch, or the module in eval "
                      "mode, gives the check a derivative to measure")
        elif unresolved:
            reason = (f"eps={eps:g} is too small for float64 to resolve these gradients (its rounding floor "
                      f"{min(worst_floor, 1e308):.3g} is over the largest gradient element {gradient_scale:.3g}); "
                      "nothing was checked: use numcheck_eps near 1e-6")
        elif only_kinks:
            reason = (f"every one of the {self.kinks} {what} taken "
                      "straddled a kink (a routing switch, a max's tie), where a difference measures no derivative: "
                      "nothing was checked" + ("; numcheck=\"exact\" or \"sampled\" take single elements"
                                               if mode == "directional" else ""))
        return Numcheck(
            mode=mode,
            eps=eps,
            dtype="float64",
            evaluations=self.evaluations,
            max_abs_error=self.worst_abs,
            max_rel_error=self.worst_rel,
            passed=None if (only_kinks or self.unsettled) and self.passed else self.passed and not unresolved,
            tolerance=tolerance,
            per_parameter=per,
            rounding_floor=min(worst_floor, 1.0e308),  # JSON has no infinity
            kinks=self.kinks,
            reason=reason,
        )
