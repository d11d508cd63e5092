"""compute(request) -> GradientResult: forward, backward, the options around them, the numerical
check, activation memory and per-phase timings. Pure PyTorch: no Redis, no HTTP, no environment."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import msgspec
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsvc.wire import Estimate, GradientRequest, GradientResult, GraphNode, PerSample, Timings

from . import numcheck, tensors
from .batch import Batch
from .errors import ComputeError, SpecError
from .memory import ActivationMeter
from .prepare import EngineConfig, GraphResolver, Prepared, batch_chunks, prepare, release_model
from .spec import leaves, prepare_for_meta

Progress = Callable[[str, int, int], None]


def resolve_device(option: str) -> torch.device:
    if option == "cpu" or (option == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ComputeError("device_unavailable", "options.device='cuda' but this worker has no CUDA device; "
                           "use device='auto' or 'cpu', or route the job to a GPU worker")
    return torch.device("cuda", torch.cuda.current_device())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_random(model: nn.Module) -> bool:
    if hasattr(model, "node_modules"):  # a GraphModel: dropout is a node, not a module
        from .graph import draws_masks

        return any(draws_masks(step) for step in model._graph.steps)
    return any(isinstance(m, nn.modules.dropout._DropoutNd) or (isinstance(m, nn.RNNBase) and m.dropout > 0)
               for m in model.modules())


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device, random: bool):
    """Same random numbers (dropout masks) for every evaluation, without touching the global RNG.
    Forking the RNG costs ~1 ms, so models without random layers (`random` False) skip it."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=random,
                               device_type="cuda"):
        if random:
            torch.manual_seed(seed)
        yield


@dataclass
class _Pass:
    """One forward and backward over the whole batch: the sums over its micro-batches."""

    loss: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    per_loss: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    input_grad: list[torch.Tensor] = field(default_factory=list)
    hvp: dict[str, torch.Tensor] = field(default_factory=dict)
    forward_s: float = 0.0
    backward_s: float = 0.0
    meter: ActivationMeter | None = None
    graph: list[GraphNode] | None = None

    def add(self, chunk: "_ChunkGrads", losses: dict[str, torch.Tensor], total: torch.Tensor) -> None:
        for name, g in chunk.params.items():
            _add(self.grads, name, g)
        for term, grads in chunk.per_loss.items():
            acc = self.per_loss.setdefault(term, {})
            for name, g in grads.items():
                _add(acc, name, g)
        for name, h in chunk.hvp.items():
            _add(self.hvp, name, h)
        if chunk.input_grad is not None:
            self.input_grad.append(chunk.input_grad.detach())
        self.loss += float(total.detach())
        for name, value in losses.items():
            self.losses[name] = self.losses.get(name, 0.0) + float(value.detach())


def _add(acc: dict[str, torch.Tensor], name: str, g: torch.Tensor) -> None:
    acc[name] = g.detach() if name not in acc else acc[name] + g.detach()


# --- micro-batching: which rows each chunk holds, and its share of a mean loss ----------------------

@dataclass
class _Chunk:
    a: int
    b: int
    inputs: Batch  # rows a:b of the batch (its floating input a leaf of its own when input_grad is asked for)
    targets: dict[str, torch.Tensor]  # the targets' rows of those batch rows
    share: float  # (b - a) / n: a mean loss is scaled by it, so the chunks' gradients sum to the batch's

    @property
    def grad_input(self) -> torch.Tensor:
        """The input whose gradient input_grad returns (prepare allowed one floating input)."""
        return self.inputs.tensors[self.inputs.floating()[0]]


def _chunks(prep: Prepared) -> Iterator[_Chunk]:
    n = prep.inputs.rows
    k = prep.rows_per_example or 1
    for a, b in batch_chunks(n, prep.options.micro_batch):
        whole = (a, b) == (0, n)
        xs = prep.inputs if whole else prep.inputs.rows_slice(a, b)
        if prep.options.input_grad:
            xs = xs.map(lambda x, _: x.detach().requires_grad_(True) if x.is_floating_point() else x)
        targets = prep.targets if whole else {name: t[a * k:b * k] for name, t in prep.targets.items()}
        yield _Chunk(a=a, b=b, inputs=xs, targets=targets, share=(b - a) / n if n else 1.0)


def _checkpointed(model: nn.Sequential, segments: int, x: torch.Tensor, meter: ActivationMeter | None):
    """checkpoint_sequential's split (the last segment runs plainly), with each checkpointed segment's
    input counted as kept: it is what checkpointing holds instead of the segment's activations."""
    modules = list(model)
    size = len(modules) // segments
    names = [str(i) for i in range(len(modules))]
    end = 0
    for start in range(0, size * (segments - 1), size):
        end = start + size
        if meter is not None:
            meter.keep(x, owner=names[start])
        x = checkpoint(lambda inp, seg=modules[start:end]: _run_modules(seg, inp), x, use_reentrant=False)
    return _run_modules(modules[end:], x)


def _run_modules(modules: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for m in modules:
        x = m(x)
    return x


def _forward(prep: Prepared, chunk: _Chunk, meter: ActivationMeter | None = None):
    """(output, {term: loss}, total) for one chunk, each mean loss scaled by the chunk's share."""
    opts = prep.options
    if opts.checkpoint_segments:
        out = _checkpointed(prep.model, opts.checkpoint_segments, chunk.inputs.first, meter)
    elif prep.graph is not None:
        try:
            out = prep.model(*chunk.inputs.tensors)
        except (RuntimeError, IndexError, ValueError) as exc:
            if _is_allocation_failure(exc):
                raise
            raise _graph_failure(prep, exc) from None
    else:
        out = prep.model(chunk.inputs.first)
    losses = {}
    for term in prep.terms:
        value = term(out, chunk.targets.get(term.name))
        if term.reduction == "mean" and chunk.share != 1.0:
            value = value * chunk.share
        losses[term.name] = value
    if len(prep.terms) == 1 and prep.terms[0].weight == 1.0:
        total = losses[prep.terms[0].name]
    else:
        total = sum(t.weight * losses[t.name] for t in prep.terms)
    return out, losses, total


# --- metering and timing ------------------------------------------------------------------------

@contextlib.contextmanager
def _metered(model: nn.Module, on: bool) -> Iterator[ActivationMeter | None]:
    """An ActivationMeter recording what the block's forward saves (None when off). Its hooks are set up
    on entry, so a clock started inside the block does not count them."""
    if not on:
        yield None
        return
    meter = ActivationMeter(model)
    with meter.recording():
        yield meter


class _Clock:
    """Seconds spent inside `with clock:` blocks, the device synchronised at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.s = 0.0
        self._t0 = 0.0

    def __enter__(self) -> "_Clock":
        _sync(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync(self.device)
        self.s += time.perf_counter() - self._t0


# --- the extra outputs: per-loss gradients, HVP, input gradients, the grad_fn graph -----------------

@dataclass
class _ChunkGrads:
    params: dict[str, torch.Tensor]
    per_loss: dict[str, dict[str, torch.Tensor]]
    hvp: dict[str, torch.Tensor]
    input_grad: torch.Tensor | None


def _wants_per_loss(prep: Prepared) -> bool:
    several = len(prep.terms) > 1
    return several if prep.options.per_loss is None else (prep.options.per_loss and several)


def _per_loss_grads(prep: Prepared, losses: dict[str, torch.Tensor], leaves_: list[torch.Tensor],
                    keep_graph: bool) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each loss term's gradients, one autograd.grad per term over the shared graph."""
    out = {}
    for i, term in enumerate(prep.terms):
        last = i == len(prep.terms) - 1
        out[term.name] = torch.autograd.grad(losses[term.name], leaves_, retain_graph=not last or keep_graph,
                                             create_graph=keep_graph, materialize_grads=True)
    return out


def _hvp(grads: list[torch.Tensor], params: dict[str, torch.Tensor],
         vector: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """H v by double backward through gradients taken with create_graph=True."""
    names = list(params)
    try:
        hv = torch.autograd.grad(grads, list(params.values()), grad_outputs=[vector[n] for n in names],
                                 materialize_grads=True)
    except RuntimeError as exc:
        if "not implemented" not in str(exc):
            raise
        raise SpecError("bad_option", f"options.hvp: torch cannot differentiate this model twice "
                        f"({str(exc).splitlines()[0][:200]}), so H v is not available for it; remove options.hvp")
    return dict(zip(names, hv))


def _twice_differentiable(on: bool):
    """Attention through its math kernel when H v is asked for: the fused CPU/CUDA kernels have no
    double backward, the math one is made of ops that do."""
    if not on:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _gradients(prep: Prepared, chunk: _Chunk, params: dict[str, torch.Tensor], losses: dict[str, torch.Tensor],
               total: torch.Tensor, hvp_vector: dict[str, torch.Tensor] | None) -> _ChunkGrads:
    """The backward of one chunk: the parameters' gradients and whatever extra outputs were asked for."""
    input_grad = prep.options.input_grad
    leaves_ = [*params.values(), *([chunk.grad_input] if input_grad else [])]
    need_hvp = hvp_vector is not None
    names = list(params)
    per_term = {}
    if _wants_per_loss(prep):
        per_term = _per_loss_grads(prep, losses, leaves_, keep_graph=need_hvp)
        grads = [sum(t.weight * per_term[t.name][j] for t in prep.terms) for j in range(len(leaves_))]
    else:
        grads = list(torch.autograd.grad(total, leaves_, create_graph=need_hvp, materialize_grads=True))
    return _ChunkGrads(
        params=dict(zip(names, grads)),
        per_loss={term: dict(zip(names, g)) for term, g in per_term.items()},
        hvp=_hvp(grads[: len(names)], params, hvp_vector) if need_hvp else {},
        input_grad=grads[-1] if input_grad else None,
    )


def _graph(root) -> list[GraphNode]:
    """The grad_fn chain from the loss: every node once, `next` as in next_functions (seed 004)."""
    ids: dict[object, int] = {}
    nodes: list[GraphNode] = []
    order = [root]
    ids[root] = 0
    i = 0
    while i < len(order):
        fn = order[i]
        nxt = []
        for child, _ in fn.next_functions:
            if child is None:
                continue
            if child not in ids:
                ids[child] = len(order)
                order.append(child)
            nxt.append(ids[child])
        nodes.append(GraphNode(id=ids[fn], name=type(fn).__name__, next=nxt))
        i += 1
    return nodes


# --- one pass, composed ---------------------------------------------------------------------------

def _run_pass(prep: Prepared, params: dict[str, torch.Tensor], device: torch.device, *, record_memory: bool,
              hvp_vector: dict[str, torch.Tensor] | None, seed: int) -> _Pass:
    """Forward and backward over the batch, chunk by chunk: the first chunk metered, each one timed,
    the extra outputs taken from its graph, everything summed into one _Pass."""
    result = _Pass()
    forward, backward = _Clock(device), _Clock(device)
    with _seeded(seed, device, _is_random(prep.model)):
        for k, chunk in enumerate(_chunks(prep)):
            with _metered(prep.model, on=record_memory and k == 0) as meter, \
                    _twice_differentiable(hvp_vector is not None):
                with forward:
                    out, losses, total = _forward(prep, chunk, meter)
            if meter is not None:  # the accounting's saved-tensor hooks ran inside the forward: memory_ms's time
                forward.s -= meter.hook_s
            result.meter = meter or result.meter
            if not math.isfinite(float(total.detach())):
                raise _non_finite(prep, float(total.detach()))
            if prep.options.graph and k == 0:
                result.graph = _graph(total.grad_fn)
            with backward:
                grads = _gradients(prep, chunk, params, losses, total, hvp_vector)
            result.add(grads, losses, total)
            del out, losses, total, grads
    result.forward_s, result.backward_s = forward.s, backward.s
    return result


def _non_finite(prep: Prepared, value: float) -> ComputeError:
    """Names the first layer whose output is not finite (a second, diagnostic forward)."""
    first = None
    handles = []

    def hook(name):
        def fn(module, args, out):
            nonlocal first
            if first is None and isinstance(out, torch.Tensor) and not tensors.all_finite(out):
                first = (name, type(module).__name__)
        return fn

    if prep.graph is not None:
        first = _first_non_finite_node(prep)
    else:
        for name, module in leaves(prep.model):
            handles.append(module.register_forward_hook(hook(name)))
        try:
            with torch.no_grad():
                prep.model(*prep.inputs.tensors)
        finally:
            for h in handles:
                h.remove()
    where = f"layer {first[0]} ({first[1]})" if first else "the loss"
    return ComputeError("non_finite", f"the loss is {value}; the first non-finite values appear in the output of "
                        f"{where}. Check the inputs' scale, the weights and the learning setup",
                        layer=first[0] if first else None, value=str(value))


def _first_non_finite_node(prep: Prepared) -> tuple[str, str] | None:
    """(module path, "node (op)") of the first graph node whose output is not finite."""
    model = prep.model
    first = None

    def visit(i, out, args, kwargs):
        nonlocal first
        if first is None and isinstance(out, torch.Tensor) and out.is_floating_point() and \
                not tensors.all_finite(out):
            name, path, _ = model.node_modules[i]
            first = (path or "(root)", f"node {name}")
    with torch.no_grad():
        model.run(*prep.inputs.tensors, visit=visit)
    return first


def _graph_failure(prep: Prepared, exc: Exception) -> SpecError:
    """A graph node that failed on this batch's values (shapes were checked before the queue): an
    index out of range, most often token ids beyond an embedding's rows."""
    i = getattr(prep.model, "failed_node", None)
    name, path, kind = prep.model.node_modules[i] if i is not None and i >= 0 else ("?", "", "")
    where = f"node {name!r} in module {path!r} ({kind})" if path else f"node {name!r}"
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return SpecError("bad_tensor", f"the graph's {where} failed on these inputs: {reason}. Check the inputs' values "
                     "(token ids must lie below the embedding's number of rows)", node=name, module=path)


def _trainable(prep: Prepared) -> dict[str, torch.Tensor]:
    params = {}
    for name, p in prep.model.named_parameters():
        p.requires_grad_(name not in prep.frozen)
        if name not in prep.frozen:
            params[name] = p
    return params


def _hvp_vector(request: GradientRequest, params: dict[str, torch.Tensor], config: EngineConfig):
    """The vector v of H v (names and shapes were checked by prepare)."""
    spec = request.options.hvp
    if spec is None:
        return None
    if isinstance(spec.vector, str):
        gen = torch.Generator().manual_seed(spec.seed)
        return {n: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device, p.dtype)
                for n, p in params.items()}
    return {name: tensors.decode(spec.vector[name], where=f"options.hvp.vector[{name!r}]",
                                 max_elements=config.limits.max_elements).to(p.device, p.dtype)
            for name, p in params.items()}


def _per_sample(prep: Prepared, params: dict[str, torch.Tensor], seed: int, device: torch.device,
                summed: bool = True) -> tuple[PerSample, dict[str, torch.Tensor] | None, _Pass]:
    """The per-example gradients (norms, or all of them); their sum or mean (as the losses reduce) for the
    check against the batch gradient when `summed`; and the batch's loss rebuilt from the examples' own
    (the whole answer when options.batch_gradient is false), timed as its backward."""
    from torch.func import functional_call, grad, vmap

    consts = {n: p.detach() for n, p in prep.model.named_parameters() if n not in params}
    consts.update(dict(prep.model.named_buffers()))
    names = [t.name for t in prep.terms]
    batch = prep.inputs
    n, k = batch.rows, prep.rows_per_example or 1

    def loss_one(ps, xs1, *tgts):  # one example: its rows of the batched inputs, the others whole
        xs = tuple(x.unsqueeze(0) if b else x for x, b in zip(xs1, batch.batched))
        out = functional_call(prep.model, {**ps, **consts}, xs)
        values = [t(out, tg) for t, tg in zip(prep.terms, tgts)]
        total = sum(t.weight * v for t, v in zip(prep.terms, values))
        return total, torch.stack([v.detach() for v in values])

    detached = {n: p.detach() for n, p in params.items()}
    in_inputs = tuple(0 if b else None for b in batch.batched)
    per_example = [prep.targets[name].reshape(n, k, *prep.targets[name].shape[1:]) for name in names]  # (n, k, ...)
    clock = _Clock(device)
    with _seeded(seed, device, _is_random(prep.model)), clock:
        try:
            grads, values = vmap(grad(loss_one, has_aux=True), in_dims=(None, in_inputs, *([0] * len(names))),
                                 randomness="different")(detached, batch.tensors, *per_example)
        except (RuntimeError, ValueError, TypeError) as exc:
            if prep.graph is None or _is_allocation_failure(exc):
                raise
            raise SpecError("bad_option", f"options.per_sample: torch.func cannot vectorise this graph over its "
                            f"examples ({str(exc).strip().splitlines()[0][:200]}); set per_sample='off'") from None
        # the norm of every example's whole gradient, no squared copy of the gradients written
        norms = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.reshape(n, -1), dim=1)
                                                      for g in grads.values()]), dim=0)  # (batch,)
    full = prep.options.per_sample == "full"
    mean = prep.terms[0].reduction == "mean"
    sums = None
    if summed:
        sums = {n: (g.to(torch.float64).mean(0) if mean else g.to(torch.float64).sum(0)) for n, g in grads.items()}
    losses = {t.name: float(values[:, j].mean() if t.reduction == "mean" else values[:, j].sum())
              for j, t in enumerate(prep.terms)}
    batch_pass = _Pass(loss=sum(t.weight * losses[t.name] for t in prep.terms), losses=losses,
                       backward_s=clock.s)
    if not math.isfinite(batch_pass.loss):
        raise _non_finite(prep, batch_pass.loss)
    return PerSample(norms=tensors.encode(norms),
                     gradients={n: tensors.encode(g) for n, g in grads.items()} if full else None), sums, batch_pass


def _numcheck(prep: Prepared, request: GradientRequest, config: EngineConfig, device: torch.device,
              progress: Progress | None, returned: dict[str, torch.Tensor],
              reference: dict[str, torch.Tensor] | None = None, job_s: float = 0.0, final: "_Pass | None" = None,
              hvp_vector: dict[str, torch.Tensor] | None = None, per_sample_sum: dict[str, torch.Tensor] | None = None):
    """Finite differences against float64 autograd, and `returned` (the gradients as the caller gets
    them) against that same float64 autograd: full batch, no checkpointing, same dropout masks."""
    opts = prep.options
    trainable = [n for n, _ in prep.model.named_parameters() if n not in prep.frozen]
    mode = opts.numcheck
    if mode == "off":
        return numcheck.unchecked(prep.dtype)
    started = time.perf_counter()
    model64 = copy.deepcopy(prep.model).to(torch.float64)
    if prep.graph is not None:
        model64.upcast_all = True  # a float64 function of the parameters, whatever casts the model makes
    x64 = prep.inputs.map(lambda x, _: x.to(torch.float64) if x.is_floating_point() else x)
    t64 = {k: (v.to(torch.float64) if v.dtype.is_floating_point else v) for k, v in prep.targets.items()}
    params = {n: p for n, p in model64.named_parameters() if n in trainable}
    for n, p in model64.named_parameters():
        p.requires_grad_(n in params)
    seed = request.model.seed

    random = _is_random(model64)
    batchable = numcheck.batchable(model64, device, graph=prep.graph is not None, random=random)

    def loss_fn() -> torch.Tensor:
        with _seeded(seed, device, random):
            out = model64(*x64.tensors)
            return sum(t.weight * t(out, t64.get(t.name)) for t in prep.terms)

    with numcheck.output_elements(model64, on=batchable and prep.graph is None) as activations:
        loss = loss_fn()
    eval_s = math.inf
    if mode == "auto":  # the cost of one float64 evaluation, as the check runs them (no grad), after a warm-up
        with torch.no_grad():
            for _ in range(2):
                t0 = time.perf_counter()
                loss_fn()
                eval_s = min(eval_s, time.perf_counter() - t0)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()), materialize_grads=True)))
    if reference is not None:
        reference.update({n: g.detach().to("cpu") for n, g in grads.items()})
    samples = opts.numcheck_samples or config.numcheck_samples
    directions = config.numcheck_directions
    batched = None
    if batchable:
        rows = numcheck.graph_output_elements(model64, x64.tensors) if prep.graph is not None else activations[0]
        batched = numcheck.batched(model64, x64.tensors, t64, prep.terms, rows)
    if mode == "auto":
        if batched is not None:  # evaluations many to a call cost less each: measure one call
            eval_s = min(eval_s, numcheck.batched_eval_s(batched, params))
        budget_s = config.numcheck_budget * job_s + config.numcheck_budget_min_s
        # What is left of the budget after the float64 copy and reference, at a margin over the measured cost
        # of an evaluation: the loop's own work (perturbing, the batched calls' copies) and a loaded machine.
        left_s = budget_s - (time.perf_counter() - started)
        plan = numcheck.plan_auto([p.numel() for p in params.values()], EVAL_MARGIN * eval_s, left_s,
                                  exact_max=config.numcheck_exact_max,
                                  samples=samples, directions=directions)
        mode, samples, directions, reason = plan
        reason = f"auto chose {reason}: within {config.numcheck_budget:g} x the job's forward+backward " \
                 f"({job_s * 1e3:.3g} ms) + {config.numcheck_budget_min_s:g} s"
    else:
        reason = f"{mode}: asked for by options.numcheck"
    check = numcheck.run(mode, params, loss_fn, grads, eps=opts.numcheck_eps, tolerance=opts.numcheck_tolerance,
                         samples=samples, directions=directions, seed=seed, progress=progress,
                         returned=returned, returned_dtype=_computed_dtype(prep), batched=batched)
    check.reason = f"{reason}; {check.reason}" if check.reason else reason
    if final is not None:
        check.quantities = _quantity_checks(prep, final, params, loss_fn, model64, x64, t64, hvp_vector,
                                            per_sample_sum, seed, device)
        check.passed = check.passed and all(q.passed for q in check.quantities.values())
    return check


EVAL_MARGIN = 1.5


def _quantity_checks(prep: Prepared, final: "_Pass", params: dict[str, torch.Tensor], loss_fn, model64, x64: Batch,
                     t64: dict[str, torch.Tensor], hvp_vector: dict[str, torch.Tensor] | None,
                     per_sample_sum: dict[str, torch.Tensor] | None, seed: int, device: torch.device) -> dict:
    """Each returned quantity besides the gradients, checked its own way (quantities.py)."""
    from . import quantities

    opts = prep.options
    exact = numcheck.returned_tolerance(_computed_dtype(prep))  # identities: the returned dtype's tolerance
    by_differences = max(exact, opts.numcheck_tolerance)  # differences in float64 resolve no better than this
    out = {}
    returned = {n: g for n, g in final.grads.items() if n in params}
    if final.per_loss:
        with _seeded(seed, device, _is_random(model64)):
            out_ = model64(*x64.tensors)
            losses = [t(out_, t64.get(t.name)) for t in prep.terms]
        reference = {}
        for k, (term, value) in enumerate(zip(prep.terms, losses)):
            grads = torch.autograd.grad(value, list(params.values()), retain_graph=k < len(losses) - 1,
                                        materialize_grads=True)
            reference[term.name] = dict(zip(params, grads))
        out["per_loss"] = quantities.per_loss({t: {n: g[n] for n in returned} for t, g in final.per_loss.items()},
                                              reference, exact)
    if per_sample_sum is not None and returned and len({t.reduction for t in prep.terms}) == 1:
        how = ("the per-example gradients " + ("averaged" if prep.terms[0].reduction == "mean" else "summed") +
               ", against the returned gradients")
        out["per_sample"] = quantities.per_sample({n: per_sample_sum[n] for n in returned}, returned,
                                                  exact,
                                                  how)
    if hvp_vector is not None and final.hvp:
        out["hvp"] = quantities.hvp(params, loss_fn, hvp_vector, final.hvp, opts.numcheck_eps, by_differences)
    if opts.input_grad and final.input_grad:
        i = x64.floating()[0]

        def loss_at(x: torch.Tensor) -> torch.Tensor:
            xs = list(x64.tensors)
            xs[i] = x
            with _seeded(seed, device, _is_random(model64)):
                out_ = model64(*xs)
                return sum(t.weight * t(out_, t64.get(t.name)) for t in prep.terms)

        out["input_gradient"] = quantities.input_gradient(loss_at, x64.tensors[i], torch.cat(final.input_grad),
                                                          opts.numcheck_eps, by_differences, seed)
    return out


def _computed_dtype(prep: Prepared) -> torch.dtype:
    """The least precise float dtype the returned gradients went through: the model's, or for a graph
    run as captured, a lower one its own casts name (HF Llama's float32 RMSNorm in a float64 model), or
    options.gradient_dtype where that is less precise."""
    computed = _model_computed_dtype(prep)
    asked = prep.options.gradient_dtype
    if asked is not None and torch.finfo(tensors.TORCH_DTYPES[asked]).eps > torch.finfo(computed).eps:
        return tensors.TORCH_DTYPES[asked]
    return computed


def _model_computed_dtype(prep: Prepared) -> torch.dtype:
    if prep.graph is None or prep.dtype != prep.graph.compiled.dtype:
        return prep.dtype  # a graph run in another dtype than captured maps its casts to that dtype
    from .graph import FloatDType

    def casts(a):
        if isinstance(a, FloatDType):
            yield a.dtype
        elif isinstance(a, (list, tuple)):
            for x in a:
                yield from casts(x)

    named = {d for step in prep.graph.compiled.steps for a in (*step.args, *step.kwargs.values()) for d in casts(a)}
    return max(named | {prep.dtype}, key=lambda d: torch.finfo(d).eps)  # the largest epsilon


def compute(request: GradientRequest, config: EngineConfig | None = None, *, progress: Progress | None = None,
            device: torch.device | None = None, graphs: GraphResolver | None = None,
            reference: dict[str, torch.Tensor] | None = None) -> GradientResult:
    """Everything POST /gradients answers, computed in this process. `graphs` resolves model.graph_ref
    (the workers pass their Redis-backed store). `reference`, when given, receives the numerical check's
    float64 autograd gradients (a shard's, for the returned-gradient check of the combined gradient)."""
    config = config or EngineConfig()
    device = device or resolve_device(request.options.device)
    try:
        return _compute(request, config, progress, device, graphs, reference)
    except torch.cuda.OutOfMemoryError as exc:
        raise _oom(device, exc) from None
    except MemoryError as exc:
        raise _oom(device, exc) from None
    except RuntimeError as exc:  # cuBLAS/cuDNN report some allocation failures as plain RuntimeErrors
        if _is_allocation_failure(exc):
            raise _oom(device, exc) from None
        raise
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _is_allocation_failure(exc: BaseException) -> bool:
    message = str(exc).lower()
    return "out of memory" in message or "can't allocate memory" in message  # CUDA/cuBLAS, CPU allocator


def _oom(device: torch.device, exc: BaseException) -> ComputeError:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ComputeError("out_of_memory", f"{device} ran out of memory ({str(exc).splitlines()[0][:200]}); set "
                        "options.micro_batch to split the batch or options.checkpoint_segments to trade memory "
                        "for recomputation, or use a smaller model", device=str(device))


def _compute(request: GradientRequest, config: EngineConfig, progress: Progress | None,
             device: torch.device, graphs: GraphResolver | None = None,
             reference: dict[str, torch.Tensor] | None = None) -> GradientResult:
    started = time.perf_counter()
    prep = prepare(request, config, device, graphs=graphs)
    _sync(device)  # the copies to the device belong to prepare_ms, not to the first timed pass
    prepare_s = time.perf_counter() - started
    with _one_thread_if_tiny(prep, device):
        result = _compute_prepared(request, config, progress, device, reference, prep, started, prepare_s)
    release_model(prep)  # after a success only: a failed compute's model is dropped
    return result


# A job this small (parameters x input elements <= ATen's grain size of 32768, which bounds each op's output
# for Linear- and Conv-like layers) runs each kernel inline on one thread anyway, yet with more intra-op
# threads every op still pays the OpenMP team's wake-ups, which on a loaded machine cost milliseconds (seed
# [A]'s job in process: 1.2 ms on one thread, 9.7 ms on two with the other core busy). So tiny CPU jobs run
# on one thread, the process's count restored after; the kernels, hence the answer, are the same.
TINY_JOB_WORK = 1 << 15


@contextlib.contextmanager
def _one_thread_if_tiny(prep: Prepared, device: torch.device) -> Iterator[None]:
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or prep.parameter_count * prep.inputs.numel() > TINY_JOB_WORK:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _compute_prepared(request: GradientRequest, config: EngineConfig, progress: Progress | None,
                      device: torch.device, reference: dict[str, torch.Tensor] | None, prep: Prepared,
                      started: float, prepare_s: float) -> GradientResult:
    opts = prep.options
    params = _trainable(prep)
    hvp_vector = _hvp_vector(request, params, config)
    seed = request.model.seed
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    per_sample, per_sample_sum = None, None
    if opts.batch_gradient:
        runs = _timed_passes(prep, params, device, hvp_vector, seed, progress)
    else:  # the examples' pass alone: its loss, no gradient of the batch
        per_sample, per_sample_sum, examples = _per_sample(prep, params, seed, device, summed=opts.numcheck != "off")
        runs = [examples]
    final = runs[-1]
    _check_gradients(final)
    if opts.gradient_dtype is not None:  # what the caller gets, and what the returned-gradient check judges
        final.grads = {n: g.to(tensors.TORCH_DTYPES[opts.gradient_dtype]) for n, g in final.grads.items()}
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    memory, memory_s = None, 0.0  # a phase that did not run took no time, not a timer's jitter
    if final.meter:
        memory_started = time.perf_counter()
        memory = final.meter.report(peak)
        memory_s = (time.perf_counter() - memory_started) + final.meter.hook_s

    checkpoint = None
    if opts.checkpoint_segments:
        checkpoint = _checkpoint_tradeoff(prep, params, device, seed, final, memory)

    if opts.per_sample != "off" and opts.batch_gradient:
        per_sample, per_sample_sum, _ = _per_sample(prep, params, seed, device, summed=opts.numcheck != "off")

    if progress:
        progress("numcheck", 0, 1)
    numcheck_started = time.perf_counter()
    # without the batch's gradient the check judges what was computed: the examples' gradients summed
    returned = final.grads if opts.batch_gradient else {
        n: g.to(_computed_dtype(prep)) for n, g in (per_sample_sum or {}).items()}
    check = _numcheck(prep, request, config, device, progress, returned, reference,
                      job_s=final.forward_s + final.backward_s, final=final, hvp_vector=hvp_vector,
                      per_sample_sum=per_sample_sum)
    numcheck_s = time.perf_counter() - numcheck_started if check is not None and check.mode != "off" else 0.0

    timed = runs[1:] if len(runs) > 1 else runs
    timings = Timings(
        prepare_ms=1e3 * prepare_s,
        forward_ms=1e3 * statistics.median(p.forward_s for p in timed),
        backward_ms=1e3 * statistics.median(p.backward_s for p in timed),
        numcheck_ms=1e3 * numcheck_s,
        memory_ms=1e3 * memory_s,
        total_ms=1e3 * (time.perf_counter() - started),
    )
    return _result(request, prep, device, final, per_sample=per_sample, hvp=hvp_vector is not None, check=check,
                   memory=memory, checkpoint=checkpoint, timings=timings)


def _timed_passes(prep: Prepared, params: dict[str, torch.Tensor], device: torch.device,
                  hvp_vector: dict[str, torch.Tensor] | None, seed: int, progress: Progress | None) -> list[_Pass]:
    """timing_repeat passes (plus one warm-up pass, not timed, when repeating); the last one is metered."""
    repeat = prep.options.timing_repeat
    if progress:
        progress("forward", 0, repeat)
    runs: list[_Pass] = []
    total = repeat + (1 if repeat > 1 else 0)
    for r in range(total):
        runs.append(_run_pass(prep, params, device, record_memory=prep.options.memory and r == total - 1,
                              hvp_vector=hvp_vector, seed=seed))
        if progress:
            progress("backward", r + 1, repeat)
    return runs


def _check_gradients(final: _Pass) -> None:
    for name, g in final.grads.items():
        if not tensors.all_finite(g):
            raise ComputeError("non_finite", f"the gradient of {name!r} holds NaN or infinite values while the loss "
                               f"is {final.loss}; lower the inputs' scale or check the weights", parameter=name)


def _result(request: GradientRequest, prep: Prepared, device: torch.device, final: _Pass, *, per_sample, hvp: bool,
            check, memory, checkpoint, timings: Timings) -> GradientResult:
    """The wire result: every tensor encoded, a frozen parameter's gradient null."""
    opts = prep.options
    several = len(prep.terms) > 1
    gradients = {n: (tensors.encode(final.grads[n]) if n in final.grads else None)
                 for n, _ in prep.model.named_parameters()}
    return GradientResult(
        device=str(device),
        dtype=request.model.dtype,
        parameter_count=prep.parameter_count,
        torch_version=str(torch.__version__),
        loss=final.loss,
        gradients=gradients,
        micro_batches=len(batch_chunks(prep.inputs.rows, opts.micro_batch)),
        losses=dict(final.losses) if several else None,
        per_loss_gradients=({t: {n: (tensors.encode(g[n]) if n in g else None) for n in gradients}
                             for t, g in final.per_loss.items()} if final.per_loss else None),
        gradient_cosine=cosines(final.per_loss) if final.per_loss else None,
        per_sample=per_sample,
        input_gradient=tensors.encode(torch.cat(final.input_grad)) if opts.input_grad else None,
        hvp={n: (tensors.encode(final.hvp[n]) if n in final.hvp else None) for n in gradients} if hvp else None,
        graph=final.graph,
        numcheck=check,
        memory=memory,
        checkpoint=checkpoint,
        timings=timings,
        graph_ref=prep.graph.ref if prep.graph is not None else None,
        seed=request.model.seed,
    )


def cosines(per_loss: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """The cosine between every pair of per-loss gradients ("a|b"): negative when the tasks pull apart."""
    flat = {k: torch.cat([g.reshape(-1).to(torch.float64) for g in v.values()]) for k, v in per_loss.items()}
    names = list(flat)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            denom = float(flat[a].norm() * flat[b].norm())
            out[f"{a}|{b}"] = float(flat[a] @ flat[b]) / denom if denom > 0 else 0.0
    return out


def _checkpoint_tradeoff(prep: Prepared, params: dict[str, torch.Tensor], device: torch.device, seed: int,
                         with_ckpt: _Pass, memory) -> dict[str, int | float]:
    """The same pass without checkpointing: what checkpointing saved in memory and cost in time."""
    plain_prep = dataclasses.replace(prep, options=msgspec.structs.replace(prep.options, checkpoint_segments=None))
    plain = _run_pass(plain_prep, params, device, record_memory=True, hvp_vector=None, seed=seed)
    saved_plain = plain.meter.report().saved_bytes_total if plain.meter else 0
    saved_ckpt = memory.saved_bytes_total if memory else 0
    t_plain = plain.forward_s + plain.backward_s
    t_ckpt = with_ckpt.forward_s + with_ckpt.backward_s
    return {
        "segments": int(prep.options.checkpoint_segments or 0),
        "saved_bytes_without": int(saved_plain),
        "saved_bytes_with": int(saved_ckpt),
        "memory_saved_bytes": int(saved_plain - saved_ckpt),
        "forward_backward_ms_without": 1e3 * t_plain,
        "forward_backward_ms_with": 1e3 * t_ckpt,
        "time_ratio": t_ckpt / t_plain if t_plain > 0 else 0.0,
    }


# POST /estimate's answers by what they depend on (_estimate_key), shared by the API's threads: every
# request is still checked in full by prepare() (its data too), only the metered meta forward that follows
# (~4 ms for a small net: torch's Python decompositions) is looked up. Read, reordered and evicted under
# the lock; a miss computes outside it (two threads missing the same key both compute; the second write wins).
_estimate_cache: OrderedDict[tuple, Estimate] = OrderedDict()
_estimate_lock = threading.Lock()
ESTIMATE_CACHE_ENTRIES = 512


def _estimate_key(request: GradientRequest, prep: Prepared) -> tuple:
    """Everything the meta forward of estimate() reads: the model's structure (the layers spec, or a graph's
    content-hash ref), dtypes and shapes of inputs and targets, the losses and every option. Not the tensor
    values nor the weights: nothing runs on meta."""
    model = prep.graph.ref if prep.graph is not None else msgspec.json.encode(request.model.layers)
    return (model, request.model.dtype, prep.inputs.signature,
            tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(prep.targets.items())),
            msgspec.json.encode((request.loss, request.losses, request.options)), frozenset(prep.frozen))


def estimate(request: GradientRequest, config: EngineConfig | None = None, *,
             graphs: GraphResolver | None = None) -> Estimate:
    """Parameter count and per-layer saved bytes, predicted on the meta device (no data touched)."""
    config = config or EngineConfig()
    prep = prepare(request, config, "meta", shape_only=True, graphs=graphs)
    key = _estimate_key(request, prep)
    with _estimate_lock:
        hit = _estimate_cache.get(key)
        if hit is not None:
            _estimate_cache.move_to_end(key)
    if hit is not None:
        return hit  # shared: callers encode it, never change it
    result = _estimate(prep)
    with _estimate_lock:
        _estimate_cache[key] = result
        while len(_estimate_cache) > ESTIMATE_CACHE_ENTRIES:
            _estimate_cache.popitem(last=False)
    return result


def _estimate(prep: Prepared) -> Estimate:
    prep.model = copy.deepcopy(prep.model)  # prepare()'s meta model is shared (prepare._meta_model)
    prepare_for_meta(prep.model)
    _trainable(prep)
    prep.inputs = prep.inputs.to("meta")
    prep.targets = {k: v.to("meta") for k, v in prep.targets.items()}
    chunk = next(_chunks(prep))
    with _metered(prep.model, on=True) as meter:
        _forward(prep, chunk, meter)
    return Estimate(parameter_count=prep.parameter_count, memory=meter.report(None))
