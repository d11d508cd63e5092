"""Shard results -> one result: the batch split across workers, combined exactly as `micro_batch`
combines chunks within one worker (a `mean` loss's share of the batch weights its shard, `sum` adds).

Each shard ran a normal request over its rows, so its `mean` losses are means over its own n_k rows;
over the batch of n rows, shard k's part of a mean term is n_k / n of it. Gradients, HVPs, input
gradients and loss values are linear in the loss, so they combine with those shares; per-example
results and input gradients are concatenated in batch order; cosines are recomputed from the
combined per-loss gradients. Sums run in the result's dtype, as micro_batch accumulates (float32 for
float16 and bfloat16 results): float64 sums of float32 gradients cost 4x the time for precision that
the float32 gradients themselves do not have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch
from torch import nn

from gradsvc.wire import Curvature, CurvatureOptions, GradientResult, Numcheck, PerSample, ShardsInfo, Tensor

from . import numcheck, tensors
from .compute import cosines
from .diagnostics import sharded as sharded_curvature
from .errors import SpecError
from .losses import OWN_LOSS
from .numcheck.run import say_unresolved
from .prepare_graph import validate_graph_split, graph_batch_flow
from .prepared import Prepared
from .spec import leaves

_ANY = 1 << 62  # results come from our own workers: no element limit to enforce here


@dataclass(frozen=True)
class ShardPlan:
    """What the reduction needs to know about the request, beyond the shards' results."""

    rows: list[int]  # rows per shard, in batch order
    reductions: dict[str, str]  # loss term name -> "mean" | "sum"
    weights: dict[str, float]  # loss term name -> its weight in the total
    several: bool  # several losses (the result then has `losses`)
    per_loss: bool  # the caller asked for per-loss gradients (a shard may compute them for the reduction only)
    curvature: dict | None = None  # options.curvature as asked (builtins), when asked
    # The Lanczos jobs' density probe ranges [a, b), one per job after the row shards (diagnostics/sharded.py)
    lanczos: list[list[int]] = field(default_factory=list)

    @property
    def uniform(self) -> bool:
        """Every term has one reduction, so one share per shard scales its whole result."""
        return len(set(self.reductions.values())) <= 1

    def share(self, k: int, term: str | None = None) -> float:
        reduction = self.reductions[term] if term is not None else next(iter(self.reductions.values()))
        return self.rows[k] / sum(self.rows) if reduction == "mean" else 1.0


def split_rows(n: int, count: int) -> list[tuple[int, int]]:
    """`count` contiguous [a, b) ranges over n rows, sizes differing by at most one, larger first
    (numpy.array_split's rule)."""
    size, extra = divmod(n, count)
    bounds, a = [], 0
    for k in range(count):
        b = a + size + (1 if k < extra else 0)
        bounds.append((a, b))
        a = b
    return bounds


def validate_shardable(prep: Prepared, count: int) -> None:
    """Refuses what a split batch cannot reproduce; `prep` is the whole request on the meta device."""
    n = prep.inputs.rows
    if count > 1 and any(t.type == OWN_LOSS for t in prep.terms):
        raise SpecError("bad_option", f"options.shards: loss {OWN_LOSS!r} is one scalar the model computes over the "
                        "whole batch, which the service cannot split across shards; set shards=1, or return "
                        "per-example outputs and use a built-in loss", option="options.shards")
    if count > 1 and prep.rows_per_example is None:
        raise SpecError("bad_option", f"options.shards: the model's output {prep.output_shape} has no rows that map "
                        f"to the batch's {n} rows in order, so the targets cannot be split with the inputs; set "
                        "shards=1", option="options.shards", output_shape=prep.output_shape, rows=n)
    if count > n:
        raise SpecError("bad_option", f"options.shards={count} exceeds the batch of {n} rows; use at most {n} "
                        "shards (or 'auto')", shards=count, rows=n)
    if prep.graph is not None:  # a graph model: its nodes, not its modules, say what mixes or draws masks
        flow = prep.batch_flow or graph_batch_flow(prep.graph, prep.dtype, prep.inputs)
        validate_graph_split(prep.graph, flow[0], "options.shards", across_jobs=True)
    for name, module in leaves(prep.model):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise SpecError("bad_option", f"options.shards: layer {name} ({type(module).__name__}) normalises with "
                            "the statistics of the whole batch in training mode, which a shard cannot see; remove "
                            "it or set shards=1", layer=name)
        if isinstance(module, nn.modules.dropout._DropoutNd):
            # Every shard seeds its masks from model.seed, so shards would repeat one mask pattern.
            raise SpecError("bad_option", f"options.shards: layer {name} ({type(module).__name__}) draws random "
                            "masks from model.seed, which every shard would repeat; remove it, or set shards=1 "
                            "and use micro_batch to bound memory", layer=name)
    reductions = {t.reduction for t in prep.terms}
    opts = prep.options
    if count > 1 and len(reductions) > 1 and opts.curvature is not None:
        raise SpecError("bad_option", "options.shards with options.curvature needs every loss to use one reduction "
                        "(all 'mean' or all 'sum'): the batch's matrix is then one weighted sum of the shards'; use "
                        "one reduction or shards=1", option="options.curvature")
    if len(reductions) > 1 and (opts.input_grad or opts.hvp is not None):
        raise SpecError("bad_option", "options.shards with input_grad or hvp needs every loss to use one reduction "
                        "(all 'mean' or all 'sum'): a shard's combined gradient cannot be split back per loss; "
                        "use one reduction or shards=1")


def plan_for(prep: Prepared, rows: list[int]) -> ShardPlan:
    several = len(prep.terms) > 1
    per_loss = several if prep.options.per_loss is None else bool(prep.options.per_loss and several)
    c = prep.options.curvature
    return ShardPlan(rows=rows, reductions={t.name: t.reduction for t in prep.terms},
                     weights={t.name: t.weight for t in prep.terms}, several=several, per_loss=per_loss,
                     curvature=None if c is None else msgspec.to_builtins(c),
                     lanczos=sharded_curvature.lanczos_ranges(c, len(rows)))


def _raw(value: Tensor) -> torch.Tensor:
    """A shard's tensor as it came (a view of the stored bytes, no copy)."""
    return tensors.decode(value, where="shard result", max_elements=_ANY, complex_ok=True)


def _t(value: Tensor) -> torch.Tensor:
    """A shard's tensor in the dtype sums run in (a copy: the stored bytes are read-only)."""
    t = _raw(value)
    return t.to(torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype, copy=True)


def _out(value: torch.Tensor, like: Tensor) -> Tensor:
    return tensors.encode(value.to(tensors.TORCH_DTYPES[like.dtype]))


def _weighted_sum(parts: list[tuple[float, Tensor | None]]) -> Tensor | None:
    """sum of share * tensor, accumulated in place; None (a frozen parameter) stays None."""
    if parts[0][1] is None:
        return None
    share, first = parts[0]
    acc = _t(first)
    if share != 1.0:
        acc.mul_(share)
    for share, value in parts[1:]:
        acc.add_(_raw(value), alpha=share)
    return _out(acc, first)


def _concat(values: list[Tensor], scales: list[float] | None = None) -> Tensor:
    out = torch.cat([_raw(v) for v in values])
    out = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    if scales and any(s != 1.0 for s in scales):
        a = 0
        for v, s in zip(values, scales):
            rows = v.shape[0]
            out[a:a + rows].mul_(s)
            a += rows
    return _out(out, values[0])


def _cosines(per_loss: dict[str, dict[str, Tensor | None]]) -> dict[str, float]:
    return cosines({k: {p: _raw(g) for p, g in v.items() if g is not None} for k, v in per_loss.items()})


def worst_numcheck(results: list[GradientResult]) -> tuple[Numcheck | None, int | None]:
    """The shard whose check is worst (a failed one first, then the largest relative error), with `passed`
    true only when every shard's passed, and null when a shard's did not run (numcheck off)."""
    checked = [(k, r.numcheck) for k, r in enumerate(results) if r.numcheck is not None]
    if not checked:
        return None, None
    k, worst = max(checked, key=lambda kc: (kc[1].passed is False, kc[1].max_rel_error))
    verdicts = [c.passed for _, c in checked]
    return msgspec.structs.replace(worst, passed=None if None in verdicts else all(verdicts)), k


def check_combined(result: GradientResult, references: list[dict[str, Tensor] | None], plan: ShardPlan,
                   shards: list[GradientResult] = ()) -> None:
    """The returned-gradient check of the combined gradient: `result.gradients` (as returned) against the
    shards' float64 references combined with the same shares, each tensor within the widest tolerance a shard
    gave it (`shards`: their results). `passed` then needs every shard's check and this one (null where a
    tensor is `unresolved`). Skipped (the worst shard's figures stay) when a shard sent no reference (numcheck
    off) or the losses mix reductions (one reference per shard cannot be split per loss)."""
    check = result.numcheck
    references = references[:len(plan.rows)]  # the Lanczos jobs after the row shards run no check
    if check is None or check.mode == "off" or not plan.uniform or not references or None in references:
        return
    reference = {}
    for name in references[0]:
        acc = torch.zeros_like(_raw(references[0][name]), dtype=torch.float64)
        for k, ref in enumerate(references):
            acc.add_(_raw(ref[name]).to(torch.float64), alpha=plan.share(k))
        reference[name] = acc
    returned = {n: _raw(result.gradients[n]) for n in reference if result.gradients.get(n) is not None}
    if set(returned) != set(reference):
        return
    # each shard's tolerances came from its own arithmetic (numcheck.arithmetic_tolerances): the widest holds,
    # tensor by tensor
    own = _widest_tolerances(shards)
    dtype = tensors.TORCH_DTYPES[result.dtype]
    r = numcheck.returned_check(returned, reference, dtype, tolerance=check.returned_tolerance or None,
                                tolerances=own or None)
    for name, rel in r.per_parameter.items():
        entry = check.per_parameter.get(name)
        if entry is not None:
            entry.returned_max_rel_error, entry.returned_judged = rel, r.judged[name]
            entry.returned_tolerance = own.get(name, entry.returned_tolerance)
    check.returned_max_rel_error, check.returned_tolerance, check.returned_floor = r.max_rel_error, r.tolerance, r.floor
    check.passed = check.passed and r.passed
    say_unresolved(check, r.unresolved, dtype)


def _widest_tolerances(shards: list[GradientResult]) -> dict[str, float]:
    """Each tensor's widest returned tolerance over the shards' checks."""
    widest: dict[str, float] = {}
    for check in (shard.numcheck for shard in shards if shard.numcheck is not None):
        for name, p in (check.per_parameter or {}).items():
            if p.returned_tolerance:
                widest[name] = max(widest.get(name, 0.0), p.returned_tolerance)
    return widest


def _memory(results: list[GradientResult]):
    """The largest shard's: the per-worker peak a sharded job needs."""
    with_memory = [r.memory for r in results if r.memory is not None]
    if not with_memory:
        return None
    return max(with_memory, key=lambda m: (m.device_peak_bytes or 0, m.saved_bytes_total))


def add_reduce_time(result: GradientResult, reduce_ms: float) -> None:
    """Counts the reduction itself (measured by the caller, around decoding and reducing) in the timings."""
    assert result.shards is not None
    result.shards.reduce_ms += reduce_ms
    result.shards.critical_path_ms += reduce_ms
    result.timings.total_ms += reduce_ms


def reduce_results(results: list[GradientResult], plan: ShardPlan, *, reduce_ms: float = 0.0) -> GradientResult:
    """One result from the shards' results (the row shards in batch order, then the Lanczos jobs), as if one
    worker had run the whole batch."""
    if len(results) != len(plan.rows) + len(plan.lanczos):
        raise ValueError(f"{len(results)} shard results for a plan of {len(plan.rows)} shards and "
                         f"{len(plan.lanczos)} Lanczos jobs")
    rows = results[:len(plan.rows)]
    first = rows[0]
    losses, per_loss = _losses(rows, plan), _per_loss_gradients(rows, plan)
    loss, gradients = _loss_and_gradients(rows, plan, losses, per_loss)
    numcheck, numcheck_shard = worst_numcheck(rows)
    info = _shards_info(results, plan, reduce_ms, numcheck_shard)
    slowest = max(results, key=lambda r: r.timings.total_ms)
    devices = sorted({r.device for r in results})
    return GradientResult(
        device=devices[0] if len(devices) == 1 else ",".join(devices),
        dtype=first.dtype,
        parameter_count=first.parameter_count,
        torch_version=first.torch_version,
        loss=loss,
        gradients=gradients,
        timings=msgspec.structs.replace(slowest.timings, total_ms=info.critical_path_ms),  # every phase of the slowest
        micro_batches=sum(r.micro_batches for r in rows),
        losses=losses,
        per_loss_gradients=per_loss if plan.per_loss else None,
        gradient_cosine=_cosines(per_loss) if plan.per_loss and per_loss else None,
        per_sample=_per_sample(rows),
        input_gradient=_input_gradient(rows, plan),
        hvp=_hvp(rows, plan),
        graph=first.graph,
        numcheck=numcheck,
        memory=_memory(results),
        checkpoint=first.checkpoint,
        graph_ref=first.graph_ref,
        capture=first.capture,
        specialised=first.specialised,
        curvature=_curvature(results, plan),
        shards=info,
        math_mode="tf32" if any(r.math_mode == "tf32" for r in results) else "ieee",  # the least precise
    )


def _losses(rows: list[GradientResult], plan: ShardPlan) -> dict[str, float] | None:
    """Each loss term's value over the batch: its shards' values with the term's shares."""
    if not plan.several:
        return None
    return {t: sum(plan.share(k, t) * r.losses[t] for k, r in enumerate(rows)) for t in plan.reductions}


def _per_loss_gradients(rows: list[GradientResult], plan: ShardPlan) -> dict[str, dict] | None:
    first = rows[0].per_loss_gradients
    if first is None:
        return None
    return {t: {p: _weighted_sum([(plan.share(k, t), r.per_loss_gradients[t][p]) for k, r in enumerate(rows)])
                for p in first[t]}
            for t in first}


def _loss_and_gradients(rows: list[GradientResult], plan: ShardPlan, losses: dict[str, float] | None,
                        per_loss: dict[str, dict] | None) -> tuple[float, dict]:
    """The loss and the gradient scale with the shard's one share (uniform reductions), or are rebuilt from
    the per-loss ones (mixed reductions: validate_shardable refused hvp and input_grad there)."""
    first = rows[0]
    if plan.uniform:
        loss = sum(plan.share(k) * r.loss for k, r in enumerate(rows))
        return loss, {p: _weighted_sum([(plan.share(k), r.gradients[p]) for k, r in enumerate(rows)])
                      for p in first.gradients}
    assert losses is not None and per_loss is not None, "mixed reductions need each shard's per-loss results"
    terms = list(plan.reductions)
    gradients = {}
    for p in first.gradients:
        parts = [per_loss[t][p] for t in terms]
        gradients[p] = None if parts[0] is None else _out(
            sum(plan.weights[t] * _t(per_loss[t][p]) for t in terms), parts[0])
    return sum(plan.weights[t] * losses[t] for t in terms), gradients


def _hvp(rows: list[GradientResult], plan: ShardPlan) -> dict | None:
    if rows[0].hvp is None:
        return None
    return {p: _weighted_sum([(plan.share(k), r.hvp[p]) for k, r in enumerate(rows)]) for p in rows[0].hvp}


def _input_gradient(rows: list[GradientResult], plan: ShardPlan) -> Tensor | None:
    if rows[0].input_gradient is None:
        return None
    return _concat([r.input_gradient for r in rows], [plan.share(k) for k in range(len(rows))])


def _per_sample(rows: list[GradientResult]) -> PerSample | None:
    """Concatenated in batch order: example i's gradient is that of its own loss, whatever the batch around it."""
    first = rows[0].per_sample
    if first is None:
        return None
    norms = _concat([r.per_sample.norms for r in rows]) if first.norms is not None else None
    grads = None
    if first.gradients is not None:
        grads = {p: _concat([r.per_sample.gradients[p] for r in rows]) for p in first.gradients}
    return PerSample(norms=norms, gradients=grads)


def _curvature(results: list[GradientResult], plan: ShardPlan) -> Curvature | None:
    if plan.curvature is None:
        return None
    count = len(plan.rows)
    return sharded_curvature.combine(msgspec.convert(plan.curvature, CurvatureOptions),
                                     [plan.share(k) for k in range(count)],
                                     [r.curvature for r in results[:count]],
                                     [r.curvature for r in results[count:]], plan.lanczos)


def _shards_info(results: list[GradientResult], plan: ShardPlan, reduce_ms: float,
                 numcheck_shard: int | None) -> ShardsInfo:
    """How the jobs ran: the critical path is the slowest job (a row shard or a Lanczos job) + the reduction."""
    totals = [r.timings.total_ms for r in results]
    return ShardsInfo(count=len(plan.rows), rows=list(plan.rows), critical_path_ms=max(totals) + reduce_ms,
                      compute_ms=sum(totals), reduce_ms=reduce_ms, shard_total_ms=totals,
                      numcheck_shard=numcheck_shard, curvature_jobs=len(plan.lanczos))
