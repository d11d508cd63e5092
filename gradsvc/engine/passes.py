"""The forward and backward passes: the batch in micro-batches (each mean loss scaled by its share), the
layers checkpointed in segments if asked, the first chunk metered, each timed, and the backward's
gradients with the extra outputs taken from the same graph (per-loss gradients, H v, the input's
gradient, the grad_fn chain), summed into one Pass. And what went wrong in a pass, named where it happened:
the first layer or graph node whose output is not finite (a second, diagnostic forward), or the graph node that
failed on this batch's values."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradsvc.wire import GraphNode

from . import tensors
from .devices import is_allocation_failure, is_random, seeded, sync
from .errors import ComputeError, SpecError
from .graph.interpreter import buffers_of
from .logprobs import of_terms
from .memory import ActivationMeter
from .outputs import written_buffers
from .prepared import Batch, Prepared, batch_chunks
from .quantities import hessian_vector, twice_differentiable
from .spec import leaves


@dataclass
class Pass:
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
    # Graph models, the batch run as one forward: the buffers it wrote (state_dict name -> new value) and,
    # with options.outputs, every output of the graph (its loss first).
    buffers: dict[str, torch.Tensor] | None = None
    outputs: list | None = None

    def add(self, chunk: "ChunkGrads", losses: dict[str, torch.Tensor], total: torch.Tensor) -> None:
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
class Chunk:
    a: int
    b: int
    inputs: Batch  # rows a:b of the batch (its floating input a leaf of its own when input_grad is asked for)
    targets: dict[str, torch.Tensor]  # the targets' rows of those batch rows
    share: float  # (b - a) / n: a mean loss is scaled by it, so the chunks' gradients sum to the batch's

    @property
    def grad_input(self) -> torch.Tensor:
        """The input whose gradient input_grad returns (prepare allowed one floating input)."""
        return self.inputs.tensors[self.inputs.floating()[0]]


def chunks(prep: Prepared, part: tuple[int, int] | None = None) -> Iterator[Chunk]:
    """The batch's micro-batches; `part`: those of its rows part[0]:part[1] alone (a session's member,
    engine/replicas.py), each still scaled by its share of the whole batch."""
    n = prep.inputs.rows
    k = prep.rows_per_example or 1
    first, last = part if part is not None else (0, n)
    spans = [(first + a, first + b) for a, b in batch_chunks(last - first, prep.options.micro_batch)]
    for a, b in spans:
        whole = (a, b) == (0, n)
        xs = prep.inputs if whole else prep.inputs.rows_slice(a, b)
        if prep.options.input_grad:
            xs = xs.map(lambda x, _: x.detach().requires_grad_(True) if x.is_floating_point() else x)
        targets = prep.targets if whole else {name: t[a * k:b * k] for name, t in prep.targets.items()}
        yield Chunk(a=a, b=b, inputs=xs, targets=targets, share=(b - a) / n if n else 1.0)


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


def forward(prep: Prepared, chunk: Chunk, meter: ActivationMeter | None = None):
    """(output, {term: loss}, total) for one chunk, each mean loss scaled by the chunk's share."""
    opts = prep.options
    if opts.checkpoint_segments:
        out = _checkpointed(prep.model, opts.checkpoint_segments, chunk.inputs.first, meter)
    elif prep.graph is not None:
        try:
            out = prep.model(*chunk.inputs.tensors)
        except (RuntimeError, IndexError, ValueError) as exc:
            if is_allocation_failure(exc):
                raise
            raise graph_failure(prep, exc) from None
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
def metered(model: nn.Module, on: bool) -> Iterator[ActivationMeter | None]:
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
        sync(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync(self.device)
        self.s += time.perf_counter() - self._t0


# --- the extra outputs: per-loss gradients, HVP, input gradients, the grad_fn graph -----------------

@dataclass
class ChunkGrads:
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



def _gradients(prep: Prepared, chunk: Chunk, params: dict[str, torch.Tensor], losses: dict[str, torch.Tensor],
               total: torch.Tensor, hvp_vector: dict[str, torch.Tensor] | None) -> ChunkGrads:
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
    return ChunkGrads(
        params=dict(zip(names, grads)),
        per_loss={term: dict(zip(names, g)) for term, g in per_term.items()},
        hvp=hessian_vector(grads[: len(names)], params, hvp_vector) if need_hvp else {},
        input_grad=grads[-1] if input_grad else None,
    )


def _graph(root) -> list[GraphNode]:
    """The grad_fn chain from the loss: every node once, `next` as in next_functions (the training loop's NllLossBackward -> AddmmBackward -> ... chain)."""
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

def run_pass(prep: Prepared, params: dict[str, torch.Tensor], device: torch.device, *, record_memory: bool,
             hvp_vector: dict[str, torch.Tensor] | None, seed: int, part: tuple[int, int] | None = None) -> Pass:
    """Forward and backward over the batch (`part`: over those of its rows), chunk by chunk: the first chunk
    metered, each one timed, the extra outputs taken from its graph, everything summed into one Pass. Buffers
    the forward writes start every pass from the request's values: each pass leaves them as one training step
    would."""
    result = Pass()
    with _written_buffers(prep, result), _kept_outputs(prep, result):
        _run_chunks(prep, params, device, (record_memory, hvp_vector, seed, part), result)
    return result


def _run_chunks(prep: Prepared, params: dict[str, torch.Tensor], device: torch.device, how: tuple,
                result: Pass) -> None:
    record_memory, hvp_vector, seed, part = how
    forward_clock, backward_clock = _Clock(device), _Clock(device)
    with seeded(seed, device, is_random(prep.model)):
        for k, chunk in enumerate(chunks(prep, part)):
            with metered(prep.model, on=record_memory and k == 0) as meter, \
                    twice_differentiable(hvp_vector is not None):
                with forward_clock:
                    out, losses, total = forward(prep, chunk, meter)
            if meter is not None:  # the accounting's saved-tensor hooks ran inside the forward: memory_ms's time
                forward_clock.s -= meter.hook_s
            result.meter = meter or result.meter
            if not math.isfinite(float(total.detach())):
                raise non_finite_error(prep, float(total.detach()))
            if prep.options.graph and k == 0:
                result.graph = _graph(total.grad_fn)
            with backward_clock:
                grads = _gradients(prep, chunk, params, losses, total, hvp_vector)
            result.add(grads, losses, total)
            del out, losses, total, grads
    result.forward_s, result.backward_s = forward_clock.s, backward_clock.s


@dataclass
class Forwarded:
    """A forward alone (forward_only): every output of the model, each loss, and per loss over class-index
    targets the log-probability of each target (its per-element loss negated)."""

    outputs: list
    losses: dict[str, float]
    logprobs: dict[str, torch.Tensor]
    seconds: float


def forward_only(prep: Prepared, device: torch.device, seed: int) -> Forwarded:
    """One forward over the whole batch without autograd, its draws from `seed` as a pass's; buffers the forward
    of a graph writes are put back (a layer spec's: the caller's)."""
    result, clock = Pass(), _Clock(device)
    with torch.no_grad(), _written_buffers(prep, result), _kept_outputs(prep, result), \
            seeded(seed, device, is_random(prep.model)):
        chunk = next(chunks(prep))
        with clock:
            out, losses, _ = forward(prep, chunk)
        logprobs = of_terms(prep.terms, out, chunk.targets)
    for name, value in losses.items():
        if not math.isfinite(float(value)):
            raise non_finite_error(prep, float(value))
    outputs = result.outputs if result.outputs is not None else [out.detach()]
    return Forwarded(outputs=outputs, losses={n: float(v) for n, v in losses.items()}, logprobs=logprobs,
                     seconds=clock.s)


def _one_forward(prep: Prepared) -> bool:
    return prep.graph is not None and len(batch_chunks(prep.inputs.rows, prep.options.micro_batch)) == 1


@contextlib.contextmanager
def _written_buffers(prep: Prepared, result: Pass) -> Iterator[None]:
    """result.buffers: what the forward wrote into the graph's buffers; their values before are put back."""
    names = written_buffers(prep.graph.compiled) if prep.graph is not None else []
    if not names:
        yield
        return
    held = buffers_of(prep.model, names)
    before = {n: b.detach().clone() for n, b in held.items()}
    try:
        yield
        if _one_forward(prep):
            result.buffers = {n: b.detach().clone() for n, b in held.items()}
    finally:
        with torch.no_grad():
            for n, b in held.items():
                b.copy_(before[n])


@contextlib.contextmanager
def _kept_outputs(prep: Prepared, result: Pass) -> Iterator[None]:
    """result.outputs: every output of the graph's run (options.outputs), read where the run returns them, so
    the metered forward (memory.py wraps the model's forward) keeps them too."""
    if not (prep.options.outputs and _one_forward(prep)):
        yield
        return
    model = prep.model
    run = model.run

    def keeping(*inputs, **kwargs):
        values = run(*inputs, **kwargs)
        result.outputs = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
        return values

    model.run = keeping  # an instance attribute: forward's self.run and the meter's graph.run find it first
    try:
        yield
    finally:
        del model.run



def trainable(prep: Prepared) -> dict[str, torch.Tensor]:
    params = {}
    for name, p in prep.model.named_parameters():
        p.requires_grad_(name not in prep.frozen)
        if name not in prep.frozen:
            params[name] = p
    return params


def non_finite_error(prep: Prepared, value: float) -> ComputeError:
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


def graph_failure(prep: Prepared, exc: Exception) -> SpecError:
    """A graph node that failed on this batch's values (shapes were checked before the queue): an
    index out of range, most often token ids beyond an embedding's rows."""
    i = getattr(prep.model, "failed_node", None)
    name, path, kind = prep.model.node_modules[i] if i is not None and i >= 0 else ("?", "", "")
    where = f"node {name!r} in module {path!r} ({kind})" if path else f"node {name!r}"
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return SpecError("bad_tensor", f"the graph's {where} failed on these inputs: {reason}. Check the inputs' values "
                     "(token ids must lie below the embedding's number of rows)", node=name, module=path)
