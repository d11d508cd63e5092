"""Several small requests of the same computation run as one: a worker's take (workers/taking.py) hands the engine
the requests it holds, and those that differ only in their tensors' values (weights, inputs, targets) run one
batched forward and backward, `torch.func.vmap` over their stacked parameters, inputs and targets, each member's
loss reduced over its own batch, its own gradient taken (`torch.func.grad`), then split into one GradientResult
per request, marked `combined: k`.

What combines (group_key): the same model structure (the layer spec, or the graph's ref), dtype, loss, options
and input and target shapes, with no option that adds a pass or reads the model beyond one forward and backward
(per-sample gradients, diagnostics, clipping, curvature, H v, input gradients, micro-batches, checkpointing,
repeats, the autograd graph, outputs, runs); no numerical check (a job whose check runs computes alone, so
its check stays its own); no buffers and no random layers; small (COMBINE_MAX_PARAMETERS, COMBINE_MAX_WORK).
Per-loss gradients (several loss terms) combine: each term's gradient is taken on its own, the total their
weighted sum, as passes.py takes them. The activation memory report depends on the structure and shapes alone: the group's first
member runs alone, metered, and the others carry its report.

Anything that fails in a group (a member's validation, a kernel without a batching rule, a non-finite loss)
leaves that member, or the whole group, to compute alone: combine() answers None for it, and the caller computes
it as it would have without a take. Equality with a lone job: the batched kernels may sum in another order than
the lone ones (docs/performance.md gives the tolerance the tests hold them to).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import msgspec
import torch
from torch.func import functional_call, grad, vmap

from gradsvc.wire import GradientRequest, GradientResult

from .compute import (Run, _numerical_check, _per_example, _postprocess, _preprocess, _refuse_non_finite_gradients,
                      execute)
from .config import EngineCaches, EngineConfig
from .devices import float32_math, is_random, math_mode_for, one_cpu_thread, sync
from .passes import Pass, trainable
from .prepare import release
from .prepared import GraphResolver
from . import tensors

log = logging.getLogger("gradsvc.engine")

# A larger job is dominated by its own arithmetic: run together, k of them gain nothing and hold k copies of the
# weights; and the job that computes a take's group waits for all of it.
COMBINE_MAX_PARAMETERS = 1 << 20
COMBINE_MAX_WORK = 1 << 24  # parameters x input elements (compute.py's TINY_JOB_WORK is 1 << 15)
_encode = msgspec.msgpack.Encoder().encode


@dataclass
class Member:
    """One request of a take: its Run once prepared (None: it computes alone), its stacked weights' share."""

    request: GradientRequest
    scope: str | None
    graphs: GraphResolver | None
    run: Run | None = None
    weights: dict[str, torch.Tensor] | None = None  # every parameter, detached copies (the model goes back)
    key: bytes | None = None


def combinable(request: GradientRequest) -> bool:
    """The options a combined run reproduces; any other asks for more than one forward and backward."""
    o = request.options
    return (request.run is None and o.numcheck == "off" and o.batch_gradient and o.per_sample == "off"
            and not o.diagnostics and o.clip is None and o.curvature is None and o.hvp is None and not o.input_grad
            and o.micro_batch is None and o.checkpoint_segments is None and o.timing_repeat == 1 and not o.graph
            and not o.outputs and o.shards == 1)


def group_key(run: Run) -> bytes | None:
    """What two prepared requests must share to run as one; None: this one computes alone."""
    prep, request = run.prep, run.request
    if prep.parameter_count > COMBINE_MAX_PARAMETERS or prep.parameter_count * prep.inputs.numel() > COMBINE_MAX_WORK:
        return None
    if any(True for _ in prep.model.buffers()):
        return None
    if not all(prep.inputs.batched) or is_random(prep.model):
        return None
    structure = prep.graph.key if prep.graph is not None else request.model.layers
    targets = sorted((k, tuple(v.shape), str(v.dtype)) for k, v in prep.targets.items())
    shapes = [(list(s), str(d), b) for s, d, b in prep.inputs.signature]
    return _encode([structure, request.model.dtype, request.loss, request.losses, request.options, shapes, targets,
                    run.math_mode, str(run.device)])


def combine(requests: list[tuple[GradientRequest, str | None, GraphResolver | None]], config: EngineConfig,
            device: torch.device, caches: EngineCaches) -> list[GradientResult | None]:
    """Each request's result, in order; None for one that did not run combined (it computes alone)."""
    members = [Member(r, scope, graphs) for r, scope, graphs in requests]
    for m in members:
        if combinable(m.request):
            _prepare(m, config, device, caches)
    groups: dict[bytes, list[Member]] = {}
    for m in members:
        if m.key is not None:
            groups.setdefault(m.key, []).append(m)
    out: dict[int, GradientResult] = {}
    for group in groups.values():
        if len(group) > 1:
            out.update(_group_results(group, caches))
    return [out.get(id(m)) for m in members]


def _prepare(m: Member, config: EngineConfig, device: torch.device, caches: EngineCaches) -> None:
    """The member validated and prepared as compute() prepares it; its weights copied out and its model handed
    back to the resident pool, so the next member of the same structure checks out the same one."""
    run = Run(m.request, config, device)
    run.math_mode = math_mode_for(device, m.request.options.math_mode or config.float32_math)
    try:
        _preprocess(run, m.graphs, caches, m.scope)
    except Exception as exc:  # noqa: BLE001  its own compute reports it, alone
        log.debug("a taken request computes alone: %s", exc)
        return
    try:
        m.key = group_key(run)
        if m.key is not None:
            m.weights = {n: p.detach().clone() for n, p in run.prep.model.named_parameters()}
            m.run = run
    finally:
        release(run.prep, caches)


def _group_results(group: list[Member], caches: EngineCaches) -> dict[int, GradientResult]:
    """The first member alone (metered, when memory is asked for), the rest batched; {id(member): result}."""
    first = group[0].run
    memory = None
    done: dict[int, GradientResult] = {}
    if first.prep.options.memory:
        lone = _alone(group[0], caches)
        if lone is None or lone.memory is None:
            return done
        memory = lone.memory
        done[id(group[0])] = lone  # computed alone, as without a take: its own answer, kept
        group = group[1:]
        if len(group) < 2:
            return done
    batched: dict[int, GradientResult] = {}
    try:
        with float32_math(first.math_mode, first.device), one_cpu_thread(first.device, first.is_tiny):
            passes = _batched(group)
            for m, p in zip(group, passes):
                result = _finish(m, p, memory, len(group))
                if result is not None:
                    batched[id(m)] = result
    except Exception as exc:  # noqa: BLE001  a kernel without a batching rule, a member's bad values: alone
        log.info("a group of %d requests computes alone (%s: %s)", len(group), type(exc).__name__, exc)
        return done
    return {**done, **batched}


def _alone(m: Member, caches: EngineCaches) -> GradientResult | None:
    """The member's own compute(), as without a take (None: it failed; it fails again, alone, for its job)."""
    run = Run(m.request, m.run.config, m.run.device)
    try:
        return execute(run, m.graphs, caches, m.scope)
    except Exception:  # noqa: BLE001
        return None


def _member_loss(model: torch.nn.Module, terms: list, frozen: dict[str, torch.Tensor], per_term: bool):
    """The function vmap runs per member: its parameters, inputs and targets -> its loss (or one term's)."""
    def loss(params, xs, ts, term=None):
        out = functional_call(model, {**params, **frozen}, tuple(xs))
        if term is not None:
            return terms[term](out, ts.get(terms[term].name))
        losses = {t.name: t(out, ts.get(t.name)) for t in terms}
        if len(terms) == 1 and terms[0].weight == 1.0:
            total = losses[terms[0].name]
        else:
            total = sum(t.weight * losses[t.name] for t in terms)
        return total, (total, losses)
    return loss


def _batched(group: list[Member]) -> list[Pass]:
    """One vmap'd forward and backward for the group; one Pass per member (the time shared out evenly)."""
    first = group[0].run
    prep, k = first.prep, len(group)
    names = list(trainable(prep))
    params = {n: torch.stack([m.weights[n] for m in group]) for n in names}
    frozen = {n: torch.stack([m.weights[n] for m in group]) for n in group[0].weights if n not in params}
    xs = [torch.stack([m.run.prep.inputs.tensors[i] for m in group]) for i in range(len(prep.inputs.tensors))]
    ts = {t: torch.stack([m.run.prep.targets[t] for m in group]) for t in prep.targets}
    per_term = len(prep.terms) > 1 and prep.options.per_loss is not False
    sync(first.device)
    started = time.perf_counter()

    def each(p, f, x, t):
        fn = _member_loss(prep.model, prep.terms, f, per_term)
        g, (total, losses) = grad(fn, has_aux=True)(p, x, t)
        per_loss = {term.name: grad(fn)(p, x, t, i) for i, term in enumerate(prep.terms)} if per_term else {}
        return g, total, losses, per_loss

    g, total, losses, per_loss = vmap(each)(params, frozen, xs, ts)
    sync(first.device)
    share = (time.perf_counter() - started) / k
    return [_pass(i, g, total, losses, per_loss, prep.terms, share) for i in range(k)]


def _pass(i: int, g, total, losses, per_loss, terms, share: float) -> Pass:
    """Member i's share of the batched outputs, as passes.run_pass would have summed it."""
    p = Pass(loss=float(total[i]), losses={n: float(v[i]) for n, v in losses.items()}, backward_s=share)
    if per_loss:
        p.per_loss = {t: {n: v[i] for n, v in grads.items()} for t, grads in per_loss.items()}
        names = list(g)
        p.grads = {n: sum(t.weight * p.per_loss[t.name][n] for t in terms) for n in names}
    else:
        p.grads = {n: v[i] for n, v in g.items()}
    return p


def _finish(m: Member, p: Pass, memory, k: int) -> GradientResult | None:
    """The rest of compute() for one member, from its Pass on; None when its values fail a check (alone, it
    fails the same way, with its own coded error)."""
    run = m.run
    if not math.isfinite(p.loss):
        return None
    run.params = {n: w for n, w in m.weights.items() if n not in run.prep.frozen}
    run.passes = [p]
    try:
        _refuse_non_finite_gradients(p)
    except Exception:  # noqa: BLE001
        return None
    run.computed = p.grads
    opts = run.prep.options
    if opts.gradient_dtype is not None:
        p.grads = {n: g.to(tensors.TORCH_DTYPES[opts.gradient_dtype]) for n, g in p.grads.items()}
    run.memory = memory
    _per_example(run)
    _numerical_check(run)
    run.final.grads = run.diagnosed.returned(run.final.grads)
    return msgspec.structs.replace(_postprocess(run), combined=k)
