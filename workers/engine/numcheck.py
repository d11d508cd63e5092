"""The numerical check: central finite differences in float64 against autograd.

Modes: `exact` perturbs every element (2P evaluations), `sampled` k random elements per tensor,
`directional` m random unit directions over all parameters (gradcheck's fast mode: 2m evaluations,
compared with grad . u). A tensor's error is max|fd - ad| / max(max|fd|, max|ad|, 1e-12).

`returned_check` judges the answer itself: the gradients exactly as returned (their dtype, summed over
micro-batches, checkpointed, accumulated over losses) against the float64 autograd reference on the
same batch, by the same ratio, in every mode (and along the directional mode's directions too).

With `batched` (compute.py builds it over torch.func.vmap when the model is a pure function of its
parameters), the perturbed losses of a tensor (or of a chunk of directions) are evaluated in one call;
`evaluations` still counts each of them. Any failure of a batched call falls back to the one-at-a-time
loop, which stays the reference.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Iterator, NamedTuple

import torch

from gradsvc.wire import Numcheck, ParameterCheck

from .losses import LOSSES, OWN_LOSS, LossTerm

Progress = Callable[[str, int, int], None]

log = logging.getLogger(__name__)

# One batched call holds at most this many float64 elements, its perturbed copies and its activations
# together (32 MiB).
BATCH_ELEMENTS = 1 << 22
# Batching pays where one evaluation is small (its ~20-60 us of Python and dispatch outweigh its arithmetic):
# an evaluation (row) holding more elements than this, perturbed tensors and activations, runs in the loop.
# Measured once each on a loaded 2-core machine (bench/numcheck_cost.py's MLPs, directional): 2.2x faster
# at 10,330 parameters, 0.8x at 103,210 and 0.3x at 1,032,010, where a row's copies and batched matmuls
# cost more than the loop's overhead.
ROW_ELEMENTS_MAX = 1 << 16
# What a failed batched call raises (torch.func's missing batching rules and refusals, a kernel's errors,
# running out of memory): the check falls back to the loop. Anything else (the worker's job timeout, which
# RQ raises asynchronously wherever the job is, a cancellation) goes through.
BATCH_FAILURES = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError, AssertionError,
                  ArithmeticError, MemoryError)


class Batched(NamedTuple):
    """Many perturbed losses in one call. `losses` takes {name: (K, *shape)} (the other parameters at their
    current values) and gives the K losses, float64; `row_elements` is what one evaluation holds beyond its
    perturbed tensors (the forward's activations), to size the chunks."""
    losses: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    row_elements: int = 0

    def rows(self, perturbed_elements: int) -> int:
        """How many evaluations one call may hold when each perturbs `perturbed_elements` elements: 0 where
        such an evaluation is too large to batch (over ROW_ELEMENTS_MAX), or two would not fit a call."""
        row = max(1, perturbed_elements + self.row_elements)
        rows = BATCH_ELEMENTS // row
        return rows if row <= ROW_ELEMENTS_MAX and rows >= 2 else 0


# Graph ops with no vmap rule (per_sample refuses them too), and custom Functions (no vmap staticmethod).
_UNBATCHABLE_OPS = ("aten.gru.", "aten.lstm.", "aten.rnn_tanh.", "aten.rnn_relu.", "function.")


def batchable(model: torch.nn.Module, device: torch.device, *, graph: bool, random: bool) -> bool:
    """Whether the check may evaluate many perturbed losses of `model` in one call (`batched`): only where a
    loss is a pure function of the parameters. Not random models (every evaluation forks the same dropout
    masks), layer specs with buffers (BatchNorm updates its running statistics in training mode), graphs
    that write a buffer (buffer mutations), an Embedding with max_norm (it renormalises its weight in
    place), recurrent layers and custom Functions (no vmap rule), nor off the CPU (not measured there)."""
    if device.type != "cpu" or random:
        return False
    if graph:
        return not model._graph.mutations and not any(s.op.name.startswith(_UNBATCHABLE_OPS) or s.writes_buffer
                                                      for s in model._graph.steps)
    return (next(model.buffers(), None) is None
            and not any(isinstance(m, torch.nn.RNNBase) or (isinstance(m, torch.nn.Embedding) and m.max_norm is not None)
                        for m in model.modules()))


def graph_output_elements(model: torch.nn.Module, inputs: tuple) -> int:
    """What one evaluation of a graph holds: every node's output elements (its modules are holders of
    parameters, never called, so module hooks would see the root's output alone)."""
    from .meta_check import attention_elements

    count = 0
    steps = model._graph.steps

    def visit(i, out, args, kwargs) -> None:
        nonlocal count
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # batched calls run attention on its math kernel, which builds the attention matrix too
        count += sum(t.numel() for t in outs if isinstance(t, torch.Tensor)) + attention_elements(steps[i], args, kwargs)

    with torch.no_grad():
        model.run(*inputs, visit=visit)
    return count


def batched_eval_s(batched: Batched, params: dict[str, torch.Tensor]) -> float:
    """The cost of one evaluation inside a batched call: the largest tensor's, as many rows as a call
    takes (up to 64), timed once (inf where it cannot be batched or the call fails)."""
    import time

    name, p = max(params.items(), key=lambda kv: kv[1].numel())
    rows = min(64, batched.rows(p.numel()))
    if rows < 2:
        return math.inf
    stacked = {name: p.detach().expand(rows, *p.shape).clone()}
    started = time.perf_counter()
    try:
        with torch.no_grad():
            batched.losses(stacked)
    except BATCH_FAILURES:
        return math.inf
    return (time.perf_counter() - started) / rows


class Plan(NamedTuple):
    """What `auto` chose: the mode, its samples or directions, and why."""

    mode: str
    samples: int
    directions: int
    reason: str


def plan_auto(sizes: list[int], eval_s: float, budget_s: float, *, exact_max: int, samples: int,
              directions: int) -> Plan:
    """The most thorough mode whose evaluations fit `budget_s` at `eval_s` each (one float64 loss, measured):
    exact (2 per element, up to `exact_max` elements), sampled (2 per sampled element, `samples` per tensor),
    directional (2 per direction), else directional with as many directions as fit (at least 2)."""
    count, tensors = sum(sizes), len(sizes)
    fits = max(0, int(budget_s / max(eval_s, 1e-9)))  # evaluations the budget buys
    per_eval = f"{eval_s * 1e3:.3g} ms an evaluation, a budget of {budget_s:.3g} s ({fits} evaluations)"
    if count <= exact_max and 2 * count <= fits:
        return Plan("exact", samples, directions, f"exact: {2 * count} evaluations fit ({per_eval})")
    sampled = 2 * sum(min(n, samples) for n in sizes)
    if sampled <= fits and sampled < 2 * count:
        return Plan("sampled", samples, directions,
                    f"sampled: up to {samples} elements of each of {tensors} tensors, {sampled} evaluations ({per_eval}; "
                    f"exact would take {2 * count})")
    d = min(directions, max(2, fits // 2))
    return Plan("directional", samples, d, f"directional: {d} directions, {2 * d} evaluations ({per_eval}; sampled "
                f"would take {sampled}, exact {2 * count})")


@contextlib.contextmanager
def output_elements(model: torch.nn.Module, on: bool = True) -> Iterator[list[int]]:
    """Counts the elements every module of `model` outputs during the block (into the list it yields): an
    upper bound on one evaluation's activations, to size the batched calls."""
    count = [0]
    if not on:
        yield count
        return

    def hook(_module, _args, out) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        count[0] += sum(t.numel() for t in outs if isinstance(t, torch.Tensor))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield count
    finally:
        for h in handles:
            h.remove()


def batched(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], targets: dict[str, torch.Tensor], terms: list[LossTerm],
            row_elements: int = 0) -> Batched:
    """`model`'s loss (sum of term.weight * term(out, target)) at K perturbed parameter sets in one call:
    torch.func.vmap over functional_call for the forward, then each term unreduced over the K x batch rows
    in one plain call, reduced row by row (vmap's rule for cross_entropy costs more than the forward)."""
    from torch.func import functional_call, vmap

    state = {n: p.detach() for n, p in model.named_parameters()}  # live views: the loop's in-place writes show

    def output(perturbed: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, {**state, **perturbed}, tuple(inputs))

    outputs = vmap(output)

    def losses(perturbed: dict[str, torch.Tensor]) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):  # attention as matmuls and softmax, which vmap batches
            out = outputs(perturbed)
        return sum(t.weight * _rows_loss(t, out, targets.get(t.name)) for t in terms)

    return Batched(losses, row_elements)


def _rows_loss(term: LossTerm, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """term(out[k], target) for each row k of `out` (K, *output shape): the K rows folded into the batch
    dimension, the loss unreduced, then reduced per row as term.reduction says ("mean" over every element
    of the unreduced loss, as torch's mean is with no class weights and no ignored targets)."""
    k = out.shape[0]
    if term.type == OWN_LOSS:  # (K, 1...) : the model's own scalar loss at each parameter set
        return out.reshape(k)
    fn, kind = LOSSES[term.type]
    if kind == "class" and out.dim() >= 3:  # (K, N, C, ...) against (N, ...) indices or (N, C, ...) probabilities
        per = fn(out.flatten(0, 1), target.expand(k, *target.shape).flatten(0, 1), reduction="none")
    else:  # shaped alike, or an unbatched (C,) class output against a () index or (C,) probabilities
        per = fn(out, target.expand(k, *target.shape), reduction="none")
    per = per.reshape(k, -1)
    return per.mean(1) if term.reduction == "mean" else per.sum(1)


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
                   tolerance: float | None = None) -> Returned:
    """`returned` (what the caller gets) against `reference` (float64 autograd, full batch, same point).

    A tensor passes when its relative error is within the dtype's tolerance, or when its absolute error
    is under tolerance x the largest reference element of the whole model (`floor`): a gradient that
    cancels to ~0 (a bias before BatchNorm) has no scale of its own to be relative to. `along` holds
    (returned . u, reference . u, sum |reference * u|) per direction of a directional check; a direction
    passes within tolerance, or under tolerance x that sum of terms. `tolerance`: another than the dtype's
    (the returned quantities checked against finite differences, quantities.py)."""
    tolerance = returned_tolerance(returned_dtype) if tolerance is None else tolerance
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
        judged[name] = _verdict(size, abs_err, per[name], tolerance, floor, zero)
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
    progress: Progress | None = None,
    returned: dict[str, torch.Tensor] | None = None,
    returned_dtype: torch.dtype = torch.float64,
    batched: Batched | None = None,
) -> Numcheck:
    """Checks `grads` (float64 autograd) against finite differences of `loss_fn` over `params`
    (float64 leaves, perturbed in place and restored). A tensor (or direction) passes when its
    relative error is within `tolerance` or its absolute error is under the rounding floor.
    With `returned` (the gradients the caller gets), those are judged against `grads` too
    (`returned_check`), and `passed` needs both. With `batched`, the same perturbed losses are
    evaluated many per call (the same perturbed values, the same figures up to the batched kernels'
    rounding), falling back to `loss_fn` one at a time if a batched call fails."""
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

    def losses_at(perturbed: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The batched losses of `perturbed`, or None (and no more batching) if the call fails. The caller
        counts the evaluations once a tensor's (or a chunk's) are all in: a failure redoes them all."""
        nonlocal batched
        try:
            out = batched.losses(perturbed).detach().to("cpu", torch.float64).reshape(-1)
            rows = next(iter(perturbed.values())).shape[0]
            if out.shape[0] != rows:
                raise RuntimeError(f"{out.shape[0]} losses for {rows} evaluations")
        except BATCH_FAILURES as exc:  # never fail a check because batching failed: the loop is the reference
            log.debug("numcheck: batched evaluation failed, evaluating one loss at a time: %r", exc)
            batched = None
            return None
        return out

    def judge(abs_err: float, rel: float, atol: float, verdict: str) -> None:
        nonlocal worst_abs, worst_rel, worst_floor, passed
        worst_abs, worst_floor = max(worst_abs, abs_err), max(worst_floor, atol)
        if verdict in ("ratio", "failed"):  # zero: noise over noise; floor: small beside the rest (per parameter)
            worst_rel = max(worst_rel, rel)
        passed = passed and verdict != "failed"

    def rounding(loss_scale: float) -> float:
        return FLOOR_ROUNDINGS * F64_EPS * max(loss_scale, 1e-300) / eps

    with torch.no_grad():
        if mode == "directional":
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
            step = max(1, batched.rows(count) // 2) if batched is not None else 1
            for first in range(0, directions, step):
                chunk = []
                for _ in range(first, min(first + step, directions)):
                    # Random signs over all parameters: a unit direction whose norm is known exactly, and
                    # ~7x cheaper to draw than a Gaussian one at a million parameters.
                    chunk.append({name: (torch.randint(0, 2, p.shape, generator=gen, dtype=torch.int8)
                                         .to(p.device, torch.float64).mul_(2).sub_(1).mul_(scale))
                                  for name, p in params.items()})
                losses = None
                if batched is not None and step > 1:
                    # Rows: p + eps u for each direction, then p - eps u for each; p itself is never written.
                    losses = losses_at({name: torch.stack([torch.add(p, us[name], alpha=sign * eps)
                                                           for sign in (1, -1) for us in chunk])
                                        for name, p in params.items()})
                    if losses is not None:
                        evaluations += 2 * len(chunk)
                for j, us in enumerate(chunk):
                    k = first + j
                    if losses is not None:
                        plus, minus = float(losses[j]), float(losses[len(chunk) + j])
                    else:  # p + eps u, then p - eps u (the batched rows' values), then p exactly as it was
                        for name, p in params.items():
                            p.add_(us[name], alpha=eps)
                        plus = loss_at()
                        for name, p in params.items():
                            p.copy_(saved[name]).add_(us[name], alpha=-eps)
                        minus = loss_at()
                        for name, p in params.items():
                            p.copy_(saved[name])
                    fd = (plus - minus) / (2 * eps)
                    ad = sum(float((grads[name] * us[name]).sum()) for name in params)
                    if returned is not None:
                        along.append((sum(float(torch.dot(returned64[n], us[n].reshape(-1))) for n in params), ad,
                                      terms))
                    abs_err = abs(fd - ad)
                    rel = abs_err / max(abs(fd), abs(ad), 1e-12)
                    atol = max(rounding(max(abs(plus), abs(minus))), tolerance * terms)
                    judge(abs_err, rel, atol, _verdict(max(abs(fd), abs(ad)), abs_err, rel, tolerance, atol,
                                                       rounding(max(abs(plus), abs(minus)))))
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
            differences: dict[str, tuple[torch.Tensor, float]] = {}  # name -> (fd, loss scale) from batched calls
            if batched is not None:
                filled: dict[str, int] = {}  # name -> elements whose differences are in
                fds = {name: torch.empty(len(ix), dtype=torch.float64) for name, ix in picks.items()}
                scales = dict.fromkeys(picks, 0.0)
                for call in _plan(params, picks, batched):
                    losses = losses_at(_perturbed(params, picks, call, eps))
                    if losses is None:
                        break
                    half = len(losses) // 2  # rows: every element at orig + eps, then each at orig - eps
                    fd_call = (losses[:half] - losses[half:]) / (2 * eps)
                    scale_call = torch.maximum(losses[:half].abs(), losses[half:].abs())
                    row = 0
                    for name, start, stop in call:
                        k = stop - start
                        fds[name][start:stop] = fd_call[row:row + k]
                        scales[name] = max(scales[name], float(scale_call[row:row + k].max()))
                        filled[name] = filled.get(name, 0) + k
                        row += k
                    if progress and (done + 2 * half) // 64 > done // 64:
                        progress("numcheck", done + 2 * half, total)
                    done += 2 * half
                differences = {name: (fds[name], scales[name]) for name, ix in picks.items()
                               if len(ix) and filled.get(name) == len(ix)}
                evaluations += sum(2 * len(picks[name]) for name in differences)
                done = evaluations  # a tensor a failed call left unfinished is redone below, one loss at a time
            checked: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}  # name -> (fd, ad, loss scale)
            for name, p in params.items():
                flat = p.view(-1)
                idx = picks[name]
                if name in differences:
                    fd, loss_scale = differences[name]
                else:
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
                checked[name] = (fd, grads[name].detach().reshape(-1)[idx].to("cpu", torch.float64), loss_scale)
            # gradcheck's rule element by element, |fd - ad| <= atol + tolerance |ad|, with atol what float64
            # and the step resolve for this loss, or the tolerance x the model's largest gradient element.
            scale = max((float(ad.abs().max()) for _, ad, _ in checked.values() if ad.numel()), default=0.0)
            for name, (fd, ad, loss_scale) in checked.items():
                abs_err = float((fd - ad).abs().max()) if ad.numel() else 0.0
                rel = _rel(abs_err, fd, ad) if ad.numel() else 0.0
                atol = max(rounding(loss_scale), tolerance * scale)
                size = max(float(fd.abs().max()), float(ad.abs().max())) if ad.numel() else 0.0
                verdict = _verdict(size, abs_err, rel, tolerance, atol, rounding(loss_scale))
                if verdict == "failed" and bool(((fd - ad).abs() <= atol + tolerance * ad.abs()).all()):
                    verdict = "floor"
                per[name] = ParameterCheck(max_abs_error=abs_err, max_rel_error=rel, checked=ad.numel(), judged=verdict)
                judge(abs_err, rel, atol, verdict)
    # A step too small (or too large) for float64 to resolve the gradients: its rounding floor is over the
    # largest gradient element, so every tensor would read as "zero". Nothing was checked; say so.
    gradient_scale = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
    rounding_only = FLOOR_ROUNDINGS * F64_EPS / eps  # the floor per unit of loss
    unresolved = not math.isfinite(worst_floor) or (gradient_scale > 0 and worst_floor >= gradient_scale
                                                    and worst_floor > tolerance * gradient_scale * 2
                                                    and rounding_only > tolerance)
    check = Numcheck(
        mode=mode,
        eps=eps,
        dtype="float64",
        evaluations=evaluations,
        max_abs_error=worst_abs,
        max_rel_error=worst_rel,
        passed=passed and not unresolved,
        tolerance=tolerance,
        per_parameter=per,
        rounding_floor=min(worst_floor, 1.0e308),  # JSON has no infinity
        reason=(f"eps={eps:g} is too small for float64 to resolve these gradients (its rounding floor "
                f"{min(worst_floor, 1e308):.3g} is over the largest gradient element {gradient_scale:.3g}); nothing "
                "was checked: use numcheck_eps near 1e-6") if unresolved else "",
    )
    if returned is None:
        return check
    r = returned_check(returned, grads, returned_dtype, along)
    for name, rel in r.per_parameter.items():
        # Directional mode has no element-wise finite differences: those entries say checked=0.
        entry = per.setdefault(name, ParameterCheck(max_abs_error=0.0, max_rel_error=0.0, checked=0))
        entry.returned_max_rel_error, entry.returned_judged = rel, r.judged[name]
    check.returned_max_rel_error, check.returned_tolerance, check.returned_floor = r.max_rel_error, r.tolerance, r.floor
    check.passed = check.passed and r.passed
    return check


Segment = tuple[str, int, int]  # (tensor, first, last + 1): elements of picks[tensor] one batched call perturbs


def _plan(params: dict[str, torch.Tensor], picks: dict[str, torch.Tensor], batched: Batched) -> list[list[Segment]]:
    """The batched calls of an element-wise check: consecutive tensors share a call while its rows (2 per
    element) times the elements each row holds (every tensor of the call, plus the activations) stay within
    BATCH_ELEMENTS; a tensor too large for that is split over calls of its own, and one too large to batch
    (`Batched.rows` 0: over ROW_ELEMENTS_MAX, or two rows over BATCH_ELEMENTS) is left to the loop."""
    calls: list[list[Segment]] = []
    call: list[Segment] = []
    rows = elements = 0  # the open call's
    for name, ix in picks.items():
        n, k = params[name].numel(), len(ix)
        if k == 0:
            continue
        if call and batched.rows(elements + n) >= rows + 2 * k:
            call.append((name, 0, k))
            rows, elements = rows + 2 * k, elements + n
            continue
        if call:
            calls.append(call)
            call, rows, elements = [], 0, 0
        per = batched.rows(n) // 2  # elements of this tensor one call may perturb
        if per < 1:
            continue
        for start in range(0, k, per):
            stop = min(start + per, k)
            call = [(name, start, stop)]
            rows, elements = 2 * (stop - start), n
            if stop < k:
                calls.append(call)
        # the last (or only) piece stays open: the next tensors may join it
    if call:
        calls.append(call)
    return calls


def _perturbed(params: dict[str, torch.Tensor], picks: dict[str, torch.Tensor], call: list[Segment],
               eps: float) -> dict[str, torch.Tensor]:
    """One batched call's rows, over the tensors of its segments: first one row per element with that element
    at orig + eps, then one per element at orig - eps (the values the loop writes), in segment order; every
    other element of those tensors at its value. One block, each tensor a view of its columns."""
    names = list(dict.fromkeys(name for name, _, _ in call))
    flats = [params[name].detach().reshape(-1) for name in names]
    offsets = dict(zip(names, [0, *torch.tensor([f.numel() for f in flats]).cumsum(0).tolist()]))
    base = torch.cat(flats) if len(flats) > 1 else flats[0]
    cols = torch.cat([picks[name][start:stop] + offsets[name] for name, start, stop in call]).to(base.device)
    half = len(cols)
    block = base.expand(2 * half, base.numel()).clone()
    at = torch.arange(half, device=base.device)
    vals = base[cols]
    block[at, cols] = vals + eps
    block[at + half, cols] = vals - eps
    return {name: block[:, offsets[name]:offsets[name] + flat.numel()].view(2 * half, *params[name].shape)
            for name, flat in zip(names, flats)}

def unchecked(dtype: torch.dtype) -> Numcheck:
    """What a result says when numcheck is "off": nothing was checked, so nothing passed, and no tolerance
    applied (both 0.0; `dtype`'s returned tolerance would read as a check that ran)."""
    return Numcheck(mode="off", eps=0.0, dtype="float64", evaluations=0, max_abs_error=0.0, max_rel_error=0.0,
                    passed=False, tolerance=0.0, per_parameter={}, returned_tolerance=0.0)
