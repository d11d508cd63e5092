"""The numerical check: central finite differences in float64 against autograd.

Modes: `exact` perturbs every element (2P evaluations), `sampled` k random elements per tensor,
`directional` m random unit directions over all parameters (gradcheck's fast mode: 2m evaluations,
compared with grad . u). A tensor's error is max|fd - ad| / max(max|fd|, max|ad|, 1e-12).

`returned_check` judges the answer itself: the gradients exactly as returned (their dtype, summed over
micro-batches, checkpointed, accumulated over losses) against the float64 autograd reference on the
same batch, by the same ratio, in every mode (and along the directional mode's directions too).

With `batched` (numcheck_batched.py: torch.func.vmap where the model is a pure function of its
parameters; check.py decides), the perturbed losses of a tensor (or of a chunk of directions) are evaluated in one call;
`evaluations` still counts each of them. Any failure of a batched call falls back to the one-at-a-time
loop, which stays the reference.
"""

from __future__ import annotations

import logging
import math
from types import MappingProxyType
from typing import Callable, NamedTuple

import torch

from gradsvc.wire import Numcheck, ParameterCheck

from .numcheck_batched import BATCH_FAILURES, Batched, _perturbed, _plan

# Called as the check goes: (phase, done, total); the worker writes it to the job (the wire Progress).
ProgressCallback = Callable[[str, int, int], None]

log = logging.getLogger(__name__)


class Plan(NamedTuple):
    """What `auto` chose: the mode, its samples or directions, why, and what the budget cut ("" if nothing)."""

    mode: str
    samples: int
    directions: int
    reason: str
    budget: int = 0
    cut: str = ""


class Work(NamedTuple):
    """What one float64 evaluation of the loss does, counted on the request's own forward: the ops (modules
    or graph nodes) it runs, the elements they output, and the floating-point operations of its matmuls,
    convolutions and attention (torch's FlopCounterMode)."""

    ops: int
    elements: int
    flops: int = 0


# A nominal machine's cost of an evaluation, to turn the budget's seconds into evaluations: per op (Python and
# dispatch) and per output element (float64 arithmetic). Fixed numbers, so that the plan is the same on any
# machine under any load; a slower machine takes longer for the same check, it never checks less.
NOMINAL_OP_S = 20e-6
NOMINAL_ELEMENT_S = 4e-9
NOMINAL_FLOP_S = 2e-10
# The job's forward+backward, in float64 evaluations: a backward costs about two forwards, and the job runs
# in the request's dtype (float32 about twice float64's speed on a CPU).
JOB_EVALUATIONS = 1.5


def nominal_eval_s(work: Work) -> float:
    """What one evaluation takes on the nominal machine."""
    return work.ops * NOMINAL_OP_S + work.elements * NOMINAL_ELEMENT_S + work.flops * NOMINAL_FLOP_S


def budget_evaluations(work: Work, budget: float, budget_min_s: float) -> int:
    """The evaluations `budget` x the job's forward+backward + `budget_min_s` buy on the nominal machine."""
    return int(budget * JOB_EVALUATIONS + budget_min_s / max(nominal_eval_s(work), 1e-9))


def plan_auto(sizes: list[int], fits: int, *, exact_max: int, samples: int, directions: int) -> Plan:
    """The most thorough mode whose evaluations fit `fits` (budget_evaluations): exact (2 per element, up
    to `exact_max` elements), sampled (2 per sampled element, `samples` per tensor, cut down to fit while
    at least 2 per tensor do), else directional (2 per direction, cut down to fit, at least 2). Only what
    is checked shrinks with the budget: a seeded subset of the same elements or directions."""
    count, tensors = sum(sizes), len(sizes)
    budget = f"a budget of {fits} evaluations"

    def sampled_cost(k: int) -> int:
        return 2 * sum(min(n, k) for n in sizes)

    if count <= exact_max and 2 * count <= fits:
        return Plan("exact", samples, directions, f"exact: {2 * count} evaluations within {budget}", fits)
    k = samples
    while k > 2 and sampled_cost(k) > fits:
        k -= 1
    if sampled_cost(k) <= fits and sampled_cost(k) < 2 * count:
        cut = "" if k == samples else (f"samples per tensor cut from {samples} to {k}: {sampled_cost(samples)} "
                                       f"evaluations would exceed {budget}")
        return Plan("sampled", k, directions, f"sampled: up to {k} elements of each of {tensors} tensors, "
                    f"{sampled_cost(k)} evaluations within {budget} (exact would take {2 * count})", fits, cut)
    d = min(directions, max(2, fits // 2))
    cut = "" if d == directions else (f"directions cut from {directions} to {d}: {2 * directions} evaluations "
                                      f"would exceed {budget}")
    return Plan("directional", samples, d, f"directional: {d} directions, {2 * d} evaluations within {budget} "
                f"(sampled would take {sampled_cost(2)}, exact {2 * count})", fits, cut)


def _rel(abs_err: float, fd: torch.Tensor, ad: torch.Tensor) -> float:
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


def returned_tolerance(dtype: torch.dtype) -> float:
    return RETURNED_TOLERANCE.get(dtype, HALF_EPSILONS * torch.finfo(dtype).eps)


# The widened tolerance: this many times the error one simulated rounding of every value moved the gradient
# by (docs/numcheck.md). Never past ARITHMETIC_MAX: a gradient 1.5x or sign-flipped still fails.
ARITHMETIC_SAFETY = 8
ARITHMETIC_MAX = 0.25


def arithmetic_tolerances(dtype: torch.dtype, grads: dict[str, torch.Tensor],
                          rounded: dict[str, torch.Tensor | None]) -> dict[str, float]:
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
        out[name] = max(base, min(ARITHMETIC_MAX, ARITHMETIC_SAFETY * _rel(err, r.detach(), g)))
    return out


class Returned(NamedTuple):
    max_rel_error: float
    per_parameter: dict[str, float]
    tolerance: float
    floor: float
    passed: bool
    judged: dict[str, str]


def _verdict(size: float, abs_err: float, rel: float, tolerance: float, atol: float, zero: float) -> str:
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
                   tolerance: float | None = None, tolerances: dict[str, float] | None = None) -> Returned:
    """`returned` (what the caller gets) against `reference` (float64 autograd, full batch, same point).

    A tensor passes when its relative error is within the dtype's tolerance, or when its absolute error
    is under tolerance x the largest reference element of the whole model (`floor`): a gradient that
    cancels to ~0 (a bias before BatchNorm) has no scale of its own to be relative to. `along` holds
    (returned . u, reference . u, sum |reference * u|) per direction of a directional check; a direction
    passes within tolerance, or under tolerance x that sum of terms. `tolerance`: another than the dtype's
    (the returned quantities checked against finite differences, quantities.py); `tolerances`: one per
    tensor (arithmetic_tolerances), the largest of them along directions and as the reported tolerance."""
    tolerance = returned_tolerance(returned_dtype) if tolerance is None else tolerance
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
        per[name] = _rel(abs_err, got, ref)
        size = max(float(got.abs().max()), float(ref.abs().max())) if ref.numel() else 0.0
        own = tolerances.get(name, tolerance)
        judged[name] = _verdict(size, abs_err, per[name], own, own * scale, zero)
        passed = passed and judged[name] != "failed"
        if judged[name] in ("ratio", "failed"):  # float32 noise on a zero gradient is no error ratio
            worst = max(worst, per[name])
    for got_u, ref_u, terms in along:
        abs_err = abs(got_u - ref_u)
        rel = abs_err / max(abs(got_u), abs(ref_u), 1e-12)
        verdict = _verdict(max(abs(got_u), abs(ref_u)), abs_err, rel, tolerance, tolerance * terms,
                           ZERO_ROUNDINGS * torch.finfo(returned_dtype).eps * terms)
        if verdict in ("ratio", "failed"):
            worst = max(worst, rel)
        passed = passed and verdict != "failed"
    return Returned(worst, per, tolerance, floor, passed, judged)


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
    progress: ProgressCallback | None = None,
    returned: dict[str, torch.Tensor] | None = None,
    returned_dtype: torch.dtype = torch.float64,
    batched: Batched | None = None,
    returned_tolerances: dict[str, float] | None = None,
) -> Numcheck:
    """Checks `grads` (float64 autograd) against finite differences of `loss_fn` over `params`
    (float64 leaves, perturbed in place and restored): `directional`, else `exact` (every element, or
    `samples` of each tensor for "sampled"). A tensor (or direction) passes when its relative error is
    within `tolerance` or its absolute error is under the rounding floor. With `returned` (the gradients
    the caller gets), those are judged against `grads` too (`returned_check`), and `passed` needs both.
    With `batched`, the same perturbed losses are evaluated many per call (the same perturbed values, the
    same figures up to the batched kernels' rounding), falling back to `loss_fn` one at a time if a
    batched call fails."""
    gen = torch.Generator().manual_seed(seed)
    tally = _Tally(loss_fn, batched, eps, tolerance, progress)
    with torch.no_grad():
        if mode == "directional":
            per, along = {}, directional(params, grads, tally, directions=directions, gen=gen, returned=returned)
        else:
            per = exact(params, grads, tally, samples=None if mode == "exact" else samples, gen=gen)
            along = []
    check = tally.summary(mode, per, grads)
    if returned is None:
        return check
    r = returned_check(returned, grads, returned_dtype, along, tolerances=returned_tolerances)
    for name, rel in r.per_parameter.items():
        # Directional mode has no element-wise finite differences: those entries say checked=0.
        entry = per.setdefault(name, ParameterCheck(max_abs_error=0.0, max_rel_error=0.0, checked=0))
        entry.returned_max_rel_error, entry.returned_judged = rel, r.judged[name]
        entry.returned_tolerance = (returned_tolerances or {}).get(name, r.tolerance)
    check.returned_max_rel_error, check.returned_tolerance, check.returned_floor = r.max_rel_error, r.tolerance, r.floor
    check.passed = check.passed and r.passed
    return check


class _Tally:
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
        return Numcheck(
            mode=mode,
            eps=eps,
            dtype="float64",
            evaluations=self.evaluations,
            max_abs_error=self.worst_abs,
            max_rel_error=self.worst_rel,
            passed=self.passed and not unresolved,
            tolerance=tolerance,
            per_parameter=per,
            rounding_floor=min(worst_floor, 1.0e308),  # JSON has no infinity
            kinks=self.kinks,
            reason=(f"eps={eps:g} is too small for float64 to resolve these gradients (its rounding floor "
                    f"{min(worst_floor, 1e308):.3g} is over the largest gradient element {gradient_scale:.3g}); "
                    "nothing was checked: use numcheck_eps near 1e-6") if unresolved else "",
        )


def directional(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], tally: _Tally, *, directions: int,
                gen: torch.Generator, returned: dict[str, torch.Tensor] | None) -> list[tuple[float, float, float]]:
    """gradcheck's fast mode: `directions` random unit directions u over all parameters, (L(p + eps u) -
    L(p - eps u)) / 2 eps against grad . u, each direction judged into `tally`. Returns, per direction,
    (returned . u, grad . u, sum |grad * u|) for the returned-gradient check (empty without `returned`)."""
    eps = tally.eps
    along: list[tuple[float, float, float]] = []
    total = 2 * directions
    count = sum(p.numel() for p in params.values())
    scale = 1.0 / math.sqrt(max(count, 1))
    # sum |reference * u| (|u| is `scale` everywhere): the size of grad . u's terms, which sets what
    # an error along u is measured against when the terms cancel.
    terms = scale * sum(float(grads[n].abs().sum()) for n in params)
    if returned is not None:  # one float64 copy
        returned64 = {n: returned[n].detach().to(p.device, torch.float64).reshape(-1) for n, p in params.items()}
    saved = {name: p.detach().clone() for name, p in params.items()}
    # Directions a batched call takes at once (each two evaluations over every parameter); 1: no batching.
    step = max(1, tally.batched.rows(count) // 2) if tally.batched is not None else 1
    for first in range(0, directions, step):
        chunk = []
        for _ in range(first, min(first + step, directions)):
            # Random signs over all parameters: a unit direction whose norm is known exactly, and
            # ~7x cheaper to draw than a Gaussian one at a million parameters.
            chunk.append({name: (torch.randint(0, 2, p.shape, generator=gen, dtype=torch.int8)
                                 .to(p.device, torch.float64).mul_(2).sub_(1).mul_(scale))
                          for name, p in params.items()})
        losses = None
        if tally.batched is not None and step > 1:
            # Rows: p + eps u for each direction, then p - eps u for each; p itself is never written.
            losses = tally.losses_at({name: torch.stack([torch.add(p, us[name], alpha=sign * eps)
                                                         for sign in (1, -1) for us in chunk])
                                      for name, p in params.items()})
            if losses is not None:
                tally.evaluations += 2 * len(chunk)
        for j, us in enumerate(chunk):
            k = first + j
            if losses is not None:
                plus, minus = float(losses[j]), float(losses[len(chunk) + j])
            else:  # p + eps u, then p - eps u (the batched rows' values), then p exactly as it was
                plus, minus = _direction_losses(params, saved, us, eps, tally)
            ad = sum(float((grads[name] * us[name]).sum()) for name in params)
            if returned is not None:
                along.append((sum(float(torch.dot(returned64[n], us[n].reshape(-1))) for n in params), ad, terms))
            _judge_direction(lambda step, u=us: _direction_losses(params, saved, u, step, tally), ad, plus, minus,
                             terms, tally)
            tally.report(2 * (k + 1), total)
    return along


def _judge_direction(losses_at: Callable[[float], tuple[float, float]], ad: float, plus: float, minus: float,
                     terms: float, tally: _Tally) -> None:
    """One direction judged into `tally` (within the tolerance, or under atol: the rounding floor or the
    tolerance x its terms), settled as exact settles an element where it would fail."""
    tolerance = tally.tolerance
    fd = (plus - minus) / (2 * tally.eps)
    floor = tally.rounding(max(abs(plus), abs(minus)))
    atol = max(floor, tolerance * terms)
    verdict = _verdict(max(abs(fd), abs(ad)), abs(fd - ad), abs(fd - ad) / max(abs(fd), abs(ad), 1e-12),
                       tolerance, atol, floor)
    if verdict == "failed":
        outcome, fd = _settle(losses_at, ad, plus, minus, max(atol, tolerance * abs(ad)), tally)
        if outcome == "kink":
            tally.kinks += 1
            return
        verdict = "ratio" if outcome == "resolved" else "failed"
    abs_err = abs(fd - ad)
    tally.judge(abs_err, abs_err / max(abs(fd), abs(ad), 1e-12), atol, verdict)


def _direction_losses(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], u: dict[str, torch.Tensor],
                      step: float, tally: _Tally) -> tuple[float, float]:
    """The losses at p + step u and p - step u; p restored from `saved`."""
    for name, p in params.items():
        p.copy_(saved[name]).add_(u[name], alpha=step)
    plus = tally.loss_at()
    for name, p in params.items():
        p.copy_(saved[name]).add_(u[name], alpha=-step)
    minus = tally.loss_at()
    for name, p in params.items():
        p.copy_(saved[name])
    return plus, minus


def exact(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], tally: _Tally, *, samples: int | None,
          gen: torch.Generator) -> dict[str, ParameterCheck]:
    """Central differences element by element: every element of each tensor, or (`samples`) that many
    random ones of each larger tensor, against autograd's; each tensor judged into `tally`."""
    picks = {}
    for name, p in params.items():
        if samples is None or p.numel() <= samples:
            picks[name] = torch.arange(p.numel())
        else:
            picks[name] = torch.randperm(p.numel(), generator=gen)[:samples].sort().values
    sides = _batched_differences(params, picks, tally) if tally.batched is not None else {}
    total = 2 * sum(len(ix) for ix in picks.values())
    done = tally.evaluations  # a tensor a failed call left unfinished is redone below, one loss at a time
    per: dict[str, ParameterCheck] = {}
    checked: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # name -> (plus, minus, ad)
    for name, p in params.items():
        flat = p.view(-1)
        idx = picks[name]
        if name not in sides:
            plus, minus = torch.empty(len(idx), dtype=torch.float64), torch.empty(len(idx), dtype=torch.float64)
            for j, i in enumerate(idx.tolist()):
                plus[j], minus[j] = _element_losses(flat, i, tally.eps, tally)
                done += 2
                if done % 64 == 0:
                    tally.report(done, total)
            sides[name] = (plus, minus)
        checked[name] = (*sides[name], grads[name].detach().reshape(-1)[idx].to("cpu", torch.float64))
    scale = max((float(ad.abs().max()) for _, _, ad in checked.values() if ad.numel()), default=0.0)
    for name, (plus, minus, ad) in checked.items():
        per[name] = _judge_tensor(params[name].view(-1), picks[name], plus, minus, ad, scale, tally)
    return per


def _element_losses(flat: torch.Tensor, i: int, step: float, tally: _Tally) -> tuple[float, float]:
    """The losses with element `i` of `flat` at orig + step and at orig - step; the element restored."""
    orig = float(flat[i])
    flat[i] = orig + step
    plus = tally.loss_at()
    flat[i] = orig - step
    minus = tally.loss_at()
    flat[i] = orig
    return plus, minus


def _judge_tensor(flat: torch.Tensor, idx: torch.Tensor, plus: torch.Tensor, minus: torch.Tensor, ad: torch.Tensor,
                  scale: float, tally: _Tally) -> ParameterCheck:
    """One tensor's verdict from its elements' losses at +-eps. gradcheck's rule element by element,
    |fd - ad| <= atol + tolerance |ad|, with atol what float64 and the step resolve for this loss, or the
    tolerance x the model's largest gradient element. A tensor that would fail has its offending elements
    settled (`_settle`): re-differenced at smaller steps, or found straddling a kink and left out."""
    tolerance, eps = tally.tolerance, tally.eps
    fd = (plus - minus) / (2 * eps)
    loss_scale = float(torch.maximum(plus.abs(), minus.abs()).max()) if len(plus) else 0.0
    atol = max(tally.rounding(loss_scale), tolerance * scale)
    kept = torch.ones(len(ad), dtype=torch.bool)
    verdict, abs_err, rel = _tensor_verdict(fd, ad, kept, atol, tally.rounding(loss_scale), tolerance)
    kinks = 0
    if verdict == "failed":
        allowed = max(atol, tolerance * float(ad.abs().max()))
        for j in ((fd - ad).abs() > allowed).nonzero().flatten().tolist():
            outcome, value = _settle(lambda step, i=int(idx[j]): _element_losses(flat, i, step, tally),
                                     float(ad[j]), float(plus[j]), float(minus[j]), allowed, tally)
            fd[j] = value
            kept[j] = outcome != "kink"
        kinks = int((~kept).sum())
        verdict, abs_err, rel = _tensor_verdict(fd, ad, kept, atol, tally.rounding(loss_scale), tolerance)
    tally.kinks += kinks
    if verdict != "kink":
        tally.judge(abs_err, rel, atol, verdict)
    return ParameterCheck(max_abs_error=abs_err, max_rel_error=rel, checked=len(ad), judged=verdict, kinks=kinks)


def _tensor_verdict(fd: torch.Tensor, ad: torch.Tensor, kept: torch.Tensor, atol: float, zero: float,
                    tolerance: float) -> tuple[str, float, float]:
    """(verdict, max abs error, relative error) over the `kept` elements; "kink" where none is kept."""
    if not len(ad):
        return "zero", 0.0, 0.0
    if not bool(kept.any()):
        return "kink", 0.0, 0.0
    fd, ad = fd[kept], ad[kept]
    abs_err = float((fd - ad).abs().max())
    rel = _rel(abs_err, fd, ad)
    size = max(float(fd.abs().max()), float(ad.abs().max()))
    verdict = _verdict(size, abs_err, rel, tolerance, atol, zero)
    if verdict == "failed" and bool(((fd - ad).abs() <= atol + tolerance * ad.abs()).all()):
        verdict = "floor"
    return verdict, abs_err, rel


# Smaller steps an offending difference is retried at, as fractions of eps: a kink straddled at eps is
# usually not at eps / 10, and float64 still resolves a difference quotient at eps / 100 for losses near 1.
SETTLE_STEPS = (0.1, 0.01)
# A kink keeps its one-sided differences apart however small the step; a smooth function's gap shrinks in
# proportion to the step. Apart by more than this many times the proportional gap: a kink.
KINK_GAP = 4.0


def _settle(losses_at: Callable[[float], tuple[float, float]], ad: float, plus: float, minus: float,
            allowed: float, tally: _Tally) -> tuple[str, float]:
    """An offending central difference (losses `plus`, `minus` at +-eps) settled: ("resolved", fd) where a
    smaller step brings it within `allowed` of `ad`; ("kink", fd) where the one-sided differences
    (f(x+h)-f(x))/h and (f(x)-f(x-h))/h stay apart at the smallest step, more than a smooth function's
    curvature keeps them, with `ad` between them (a subgradient); else ("failed", fd): a wrong gradient."""
    eps = tally.eps
    base = tally.base_loss()
    gap0 = abs((plus - base) - (base - minus)) / eps
    fd = (plus - minus) / (2 * eps)
    right = left = fd
    step = eps
    for fraction in SETTLE_STEPS:
        step = eps * fraction
        plus, minus = losses_at(step)
        fd = (plus - minus) / (2 * step)
        if abs(fd - ad) <= allowed + tally.rounding(max(abs(plus), abs(minus))) * eps / step:
            return "resolved", fd
        right, left = (plus - base) / step, (base - minus) / step
    rounding = 2 * tally.rounding(max(abs(plus), abs(minus), abs(base))) * eps / step
    apart = abs(right - left) > KINK_GAP * gap0 * step / eps + rounding
    between = min(right, left) - allowed - rounding <= ad <= max(right, left) + allowed + rounding
    return ("kink" if apart and between else "failed"), fd


def _batched_differences(params: dict[str, torch.Tensor], picks: dict[str, torch.Tensor],
                         tally: _Tally) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (the picked elements' losses at +eps, at -eps) for every tensor whose batched calls all
    succeeded (counted into the tally's evaluations); the others are left to exact's loop."""
    filled: dict[str, int] = {}  # name -> elements whose differences are in
    pluses = {name: torch.empty(len(ix), dtype=torch.float64) for name, ix in picks.items()}
    minuses = {name: torch.empty(len(ix), dtype=torch.float64) for name, ix in picks.items()}
    total = 2 * sum(len(ix) for ix in picks.values())
    done = 0
    for call in _plan(params, picks, tally.batched):
        losses = tally.losses_at(_perturbed(params, picks, call, tally.eps))
        if losses is None:
            break
        half = len(losses) // 2  # rows: every element at orig + eps, then each at orig - eps
        row = 0
        for name, start, stop in call:
            k = stop - start
            pluses[name][start:stop] = losses[row:row + k]
            minuses[name][start:stop] = losses[half + row:half + row + k]
            filled[name] = filled.get(name, 0) + k
            row += k
        if (done + 2 * half) // 64 > done // 64:
            tally.report(done + 2 * half, total)
        done += 2 * half
    sides = {name: (pluses[name], minuses[name]) for name, ix in picks.items()
             if len(ix) and filled.get(name) == len(ix)}
    tally.evaluations += sum(2 * len(picks[name]) for name in sides)
    return sides



def unchecked(dtype: torch.dtype) -> Numcheck:
    """What a result says when numcheck is "off": nothing was checked, so nothing passed, and no tolerance
    applied (both 0.0; `dtype`'s returned tolerance would read as a check that ran)."""
    return Numcheck(mode="off", eps=0.0, dtype="float64", evaluations=0, max_abs_error=0.0, max_rel_error=0.0,
                    passed=False, tolerance=0.0, per_parameter={}, returned_tolerance=0.0)
