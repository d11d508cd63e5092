"""Request -> checked, ready-to-run pieces (model, inputs, targets, loss terms), on meta or a device.

The API runs this on the meta device to reject a bad request before it is queued; the worker runs
it on its device. Both see the same checks, so a request that passes here does not fail later for
a reason that could have been known.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import torch
from torch import nn

from gradsvc import hashing
from gradsvc.lru import LRU
from gradsvc.wire import MAX_TIMING_REPEAT, GradientRequest, GraphSpec, LossSpec, Options, Tensor, is_tensor

from . import tensors
from .batch import Batch
from .errors import SpecError
from .losses import OWN_LOSS, LossTerm, make_term, own_term, prepare_target
from .spec import Limits, build, check_shapes, leaves, sequence_first


@dataclass(frozen=True)
class EngineConfig:
    limits: Limits = field(default_factory=Limits)
    numcheck_exact_max: int = 20_000
    numcheck_samples: int = 8
    numcheck_directions: int = 16
    numcheck_budget: float = 10.0  # auto: evaluations within this many times the job's forward+backward ...
    numcheck_budget_min_s: float = 0.25  # ... plus this
    max_timing_repeat: int = MAX_TIMING_REPEAT
    init_cache_bytes: int = 1 << 30


@dataclass
class Prepared:
    model: nn.Sequential
    dtype: torch.dtype
    inputs: Batch
    targets: dict[str, torch.Tensor]  # loss term name -> target
    terms: list[LossTerm]
    output_shape: list[int]
    parameter_count: int
    options: Options
    frozen: set[str]
    graph: "GraphTemplate | None" = None  # graph models: the validated graph (its ref, state, input dtype)
    graph_data: bytes | None = None  # model.graph's canonical bytes (what the API stores under its ref)
    reuse_key: tuple | None = None  # set when `model` may go back to the built-model cache (release_model)
    # Output (and target) rows per batch row, where the output's rows map to the batch's in order (1 for a
    # classifier, seq for every-position LM logits flattened to (batch*seq, vocab)); None where they do
    # not: then nothing may split the batch (prepare refused micro_batch, per_sample and shards).
    rows_per_example: int | None = 1

    @property
    def gradient_bytes(self) -> int:
        """What the gradients alone take in the result (one per parameter, in the model's dtype)."""
        return self.parameter_count * self.dtype.itemsize


def _terms(request: GradientRequest) -> list[LossTerm]:
    if request.losses is not None:
        if request.loss is not None:
            raise SpecError("bad_loss", "give either 'loss' or 'losses', not both")
        if not request.losses:
            raise SpecError("bad_loss", "'losses' is empty; give at least one loss or use 'loss'")
        terms = []
        for i, spec in enumerate(request.losses):
            name = spec.name or f"loss{i}"
            if any(t.name == name for t in terms):
                raise SpecError("bad_loss", f"two losses are named {name!r}; give each a distinct 'name'", loss=name)
            terms.append(make_term(name, spec.type, spec.reduction, spec.weight, spec.target))
        return terms
    loss = request.loss if request.loss is not None else "cross_entropy"
    if loss == OWN_LOSS or (isinstance(loss, LossSpec) and loss.type == OWN_LOSS):
        return [own_term(loss)]
    if isinstance(loss, str):
        return [make_term("loss", loss, "mean", 1.0, None)]
    assert isinstance(loss, LossSpec)
    return [make_term(loss.name or "loss", loss.type, loss.reduction, loss.weight, None)]


def _target_for(term: LossTerm, targets, *, max_elements: int, shape_only: bool) -> torch.Tensor:
    if isinstance(targets, dict) and not is_tensor(targets):
        key = term.target or term.name
        if key not in targets:
            raise SpecError("bad_target", f"{term.label} ({term.type}) needs targets[{key!r}]; targets has "
                            f"{sorted(targets)}. Name it in the loss's 'target' field", loss=term.name)
        raw = targets[key]
        where = f"targets.{key}"
    else:
        if term.target is not None:
            raise SpecError("bad_target", f"{term.label} names target {term.target!r}, but 'targets' is a "
                            "single tensor; send an object of named targets", loss=term.name)
        raw, where = targets, "targets"
    if raw is None:
        raise SpecError("bad_target", f"{term.label} ({term.type}) needs targets; add 'targets' to the request",
                        loss=term.name)
    return tensors.decode(_as_tensor_value(raw, where), where=where, max_elements=max_elements,
                          shape_only=shape_only)


def _targets(request: GradientRequest, terms: list[LossTerm], out: torch.Tensor, dtype: torch.dtype,
             max_elements: int, shape_only: bool) -> dict[str, torch.Tensor]:
    """Each loss term's target, checked against the model's output (its shape and the loss's rules, not
    the inputs' batch size: every-position LM logits (batch*seq, vocab) take targets (batch*seq,)). The
    model's own loss ("output") takes none."""
    if any(t.type == OWN_LOSS for t in terms):
        if request.targets is not None:
            raise SpecError("bad_target", f"loss {OWN_LOSS!r} differentiates the model's own first output, which "
                            "takes no targets; leave 'targets' out (pass labels to the model as an input instead)")
        if out.numel() != 1:
            raise SpecError("bad_loss", f"loss {OWN_LOSS!r} differentiates the model's first output, which must be "
                            f"a scalar (a loss), but it has shape {list(out.shape)}; return the loss first (a Hugging "
                            "Face model returns .loss first when given labels=), or use a built-in loss",
                            output_shape=list(out.shape))
        return {}
    return {t.name: prepare_target(t, out, _target_for(t, request.targets, max_elements=max_elements,
                                                    shape_only=shape_only), dtype)
            for t in terms}


def _splits(opts: Options, rows: int) -> list[str]:
    """The options of this request that split the batch into parts of rows."""
    out = []
    if opts.micro_batch is not None and opts.micro_batch < rows:
        out.append("options.micro_batch")
    if opts.per_sample != "off":
        out.append("options.per_sample")
    if isinstance(opts.shards, int) and opts.shards > 1:  # "auto" is checked with its count (check_shardable)
        out.append("options.shards")
    return out


def _refuse_own_loss_split(opts: Options, terms: list[LossTerm], rows: int) -> None:
    split = _splits(opts, rows)
    if split and any(t.type == OWN_LOSS for t in terms):
        raise SpecError("bad_option", f"{split[0]}: loss {OWN_LOSS!r} is one scalar the model computes over the "
                        "whole batch, which the service cannot split into parts of the batch; remove "
                        f"{split[0]}, or return per-example outputs and use a built-in loss", option=split[0])


def _rows_per_example(opts: Options, inputs: Batch, out: torch.Tensor,
                      out_batch: tuple[int, int] | None) -> int | None:
    """How many output rows each batch row owns, when the output's rows follow the batch's in order
    (`out_batch` is where the batch sits in the output: (dim, rows per example)); refuses an option that
    splits the batch when they do not (a part of the batch would not know its targets' rows)."""
    n = inputs.rows
    k = None
    if out_batch is not None and out_batch[0] == 0 and out.dim() >= 1 and out.shape[0] == n * out_batch[1]:
        k = out_batch[1]
    split = _splits(opts, n)
    if not split:
        return k
    if not any(inputs.batched):
        raise SpecError("bad_option", f"{split[0]}: no input of the model carries a batch dimension, so there are "
                        f"no rows to split; remove {split[0]}", option=split[0])
    if k is None:
        raise SpecError("bad_option", f"{split[0]}: the model's output {list(out.shape)} has no rows that map to "
                        f"the batch's {n} rows in order (its first dimension is neither the batch nor batch x "
                        "positions), so the targets cannot be split with the inputs; remove "
                        f"{split[0]}", option=split[0], output_shape=list(out.shape), rows=n)
    return k


def _check_options(opts: Options, config: EngineConfig, batch: int, top_layers: int, names: list[str]) -> set[str]:
    def bad(msg: str, **detail) -> None:
        raise SpecError("bad_option", msg, **detail)

    if not (0 < opts.numcheck_eps < 1):
        bad(f"options.numcheck_eps={opts.numcheck_eps} must lie in (0, 1); 1e-6 suits float64",
            option="numcheck_eps", value=opts.numcheck_eps)
    if opts.numcheck_samples is not None and opts.numcheck_samples < 1:
        bad("options.numcheck_samples must be at least 1", option="numcheck_samples", value=opts.numcheck_samples)
    if not (opts.numcheck_tolerance > 0):
        bad("options.numcheck_tolerance must be positive", option="numcheck_tolerance", value=opts.numcheck_tolerance)
    if not (1 <= opts.timing_repeat <= config.max_timing_repeat):
        bad(f"options.timing_repeat must lie in [1, {config.max_timing_repeat}], got {opts.timing_repeat}",
            option="timing_repeat", value=opts.timing_repeat, max=config.max_timing_repeat)
    if opts.micro_batch is not None and not (1 <= opts.micro_batch):
        bad(f"options.micro_batch must be at least 1, got {opts.micro_batch}", option="micro_batch",
            value=opts.micro_batch)
    if opts.checkpoint_segments is not None and not (1 <= opts.checkpoint_segments <= top_layers):
        bad(f"options.checkpoint_segments must lie in [1, {top_layers}] (the number of top-level layers), "
            f"got {opts.checkpoint_segments}", option="checkpoint_segments", value=opts.checkpoint_segments,
            max=top_layers)
    frozen = set()
    for prefix in opts.freeze:
        hit = [n for n in names if n == prefix or n.startswith(prefix.rstrip(".") + ".")]
        if not hit:
            bad(f"options.freeze: prefix {prefix!r} matches no parameter; parameters are {names[:8]}"
                f"{' ...' if len(names) > 8 else ''}", option="freeze", prefix=prefix)
        frozen.update(hit)
    if names and len(frozen) == len(names):
        bad("options.freeze freezes every parameter; leave at least one trainable", option="freeze",
            parameters=len(names))
    if not names and not opts.input_grad:
        bad("the model has no parameters, so there is no gradient to return; set options.input_grad=true for "
            "the gradient with respect to the inputs", option="input_grad")
    del batch
    return frozen


def _check_batch_statistics(opts: Options, model: nn.Module, batch: int,
                            mixing: list[tuple[str, nn.Module]] | None = None) -> None:
    """micro_batch and per_sample split the batch. A layer that mixes the examples of a batch
    (BatchNorm in training mode: it normalises with the batch's mean and variance) makes either
    inexact, so both are refused here, before the queue, rather than answered with other gradients."""
    splits = opts.per_sample != "off" or (opts.micro_batch is not None and opts.micro_batch < batch)
    option = "options.per_sample" if opts.per_sample != "off" else "options.micro_batch"
    hit = sequence_first(model) if splits else None
    if hit:
        raise SpecError("bad_option", f"{option}: layer {hit[0]} ({type(hit[1]).__name__}) takes (sequence, batch, "
                        "...) with batch_first=false, and the batch is split along dim 0; set batch_first=true "
                        f"(and send batch-first inputs) or leave {option} out", layer=hit[0])
    if opts.per_sample != "off":
        for name, module in model.named_modules():
            if isinstance(module, nn.RNNBase) or (isinstance(module, nn.Embedding) and module.max_norm is not None):
                raise SpecError("bad_option", f"options.per_sample: layer {name} ({type(module).__name__}) cannot "
                                "run under torch.func.vmap, which per-example gradients use (recurrent layers, "
                                "Embedding with max_norm); set per_sample='off'", layer=name)
    if mixing is None:
        mixing = _batch_stat_leaves(model)
    if not mixing:
        return
    name, kind = mixing[0][0], type(mixing[0][1]).__name__
    if opts.micro_batch is not None and opts.micro_batch < batch:
        raise SpecError("bad_option", f"options.micro_batch={opts.micro_batch}: layer {name} ({kind}) normalises with "
                        "the statistics of the whole batch in training mode, so gradients summed over micro-batches "
                        f"would differ from the batch's; remove options.micro_batch (or set it to at least the batch "
                        f"size, {batch}), or remove the layer", layer=name, option="micro_batch")
    if opts.per_sample != "off":
        raise SpecError("bad_option", f"options.per_sample: layer {name} ({kind}) mixes the samples of a batch in "
                        "training mode, so per-example gradients are undefined; remove it or set per_sample='off'",
                        layer=name, option="per_sample")


def _batch_stat_leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in leaves(model) if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]


def _check_hvp(opts: Options, model: nn.Module, frozen: set[str]) -> None:
    """The HVP vector's names and shapes, checked before the job is queued."""
    if opts.hvp is None:
        return
    vector = opts.hvp.vector
    if isinstance(vector, str):
        if vector != "random":
            raise SpecError("bad_option", f"options.hvp.vector={vector!r}: use 'random' or an object "
                            "{parameter: tensor} with every trainable parameter", option="hvp.vector",
                            value=vector, valid=["random", "{parameter: tensor}"])
        return
    trainable = {n: list(p.shape) for n, p in model.named_parameters() if n not in frozen}
    for name in trainable:
        if name not in vector:
            raise SpecError("bad_option", f"options.hvp.vector: parameter {name!r} is missing; give a tensor for "
                            "every trainable parameter", parameter=name)
    for name, wire in vector.items():
        if name not in trainable:
            raise SpecError("bad_option", f"options.hvp.vector: {name!r} is not a trainable parameter; they are "
                            f"{sorted(trainable)[:12]}", parameter=name)
        if list(wire.shape) != trainable[name]:
            raise SpecError("bad_option", f"options.hvp.vector[{name!r}] has shape {list(wire.shape)}, expected "
                            f"{trainable[name]}", parameter=name)


def _decode_weights(given: dict, state: dict[str, torch.Tensor], parameters, dtype: torch.dtype,
                    max_elements: int, owner: str) -> dict[str, torch.Tensor]:
    """The given weights as tensors, each checked against the state entry of its name: shape; parameters
    cast to the model's dtype and finite; buffers cast to their own dtype."""
    out = {}
    for name, wire in given.items():
        t = tensors.decode(wire, where=f"weights[{name!r}]", max_elements=max_elements)
        want = list(state[name].shape)
        if list(t.shape) != want:
            raise SpecError("bad_weights", f"weights: {name!r} has shape {list(t.shape)}, {owner} needs {want}",
                            parameter=name, shape=list(t.shape), expected=want)
        if name in parameters:
            t = t.to(dtype)
            if not t.is_meta and not tensors.all_finite(t):
                raise SpecError("bad_weights", f"weights: {name!r} holds NaN or infinite values", parameter=name)
        else:
            t = t.to(state[name].dtype)
        out[name] = t
    return out


def _weights(request: GradientRequest, facts: "_Facts", dtype: torch.dtype, max_elements: int) -> dict[str, torch.Tensor]:
    given = request.model.weights or {}
    state, params = facts.state, facts.names
    for name in given:
        if name not in state:
            raise SpecError("bad_weights", f"weights: unknown parameter {name!r}; the model has "
                            f"{sorted(state)[:12]}", parameter=name)
    missing = [n for n in params if n not in given]
    if given and missing:
        raise SpecError("bad_weights", f"weights: parameter {missing[0]!r} is missing; when weights are given, "
                        "every parameter must be (buffers are optional)", parameter=missing[0])
    return _decode_weights(given, state, set(params), dtype, max_elements, "the model")


# graph_ref -> the stored graph (or None): the API's and the workers' Redis-backed store. The engine
# itself keeps no store, only the validated graphs it has seen (GraphTemplate, below).
GraphResolver = Callable[[str], "GraphSpec | None"]


def prepare(request: GradientRequest, config: EngineConfig, device: str | torch.device = "meta", *,
            shape_only: bool = False, graphs: GraphResolver | None = None) -> Prepared:
    """Checks and builds everything; on "meta" nothing runs. `shape_only` (POST /estimate) accepts
    inputs and targets given as dtype and shape alone. `graphs` resolves `model.graph_ref`."""
    limits = config.limits
    dtype_name = request.model.dtype
    if dtype_name not in tensors.FLOAT_DTYPES:
        raise SpecError("bad_option", f"model.dtype {dtype_name!r} is not a floating-point dtype; use one of "
                        f"{', '.join(tensors.FLOAT_DTYPES)}")
    dtype = tensors.TORCH_DTYPES[dtype_name]
    given = [k for k in ("layers", "graph", "graph_ref") if getattr(request.model, k) is not None]
    if len(given) != 1:
        raise SpecError("bad_option", f"model: give exactly one of 'layers', 'graph' or 'graph_ref', got "
                        f"{given or 'none'}", given=given)
    if request.model.layers is None:
        return _prepare_graph(request, config, device, dtype, shape_only=shape_only, graphs=graphs)
    spec_key = msgspec.json.encode(request.model.layers)  # the caches below are keyed by the spec
    meta, facts = _meta_model(spec_key, request, dtype, limits)  # shared, read-only: the checks only read it
    raw = _as_tensor_value(_input_values(request.inputs, ["inputs"], what="a layer spec")[0][1], "inputs")
    inputs = tensors.decode(raw, where="inputs", max_elements=limits.max_elements, shape_only=shape_only)
    first = facts.first
    if isinstance(first, nn.Embedding):
        if inputs.dtype.is_floating_point or inputs.dtype == torch.bool:
            raise SpecError("bad_tensor", "inputs: the first layer is Embedding, which takes integer indices; "
                            f"got {inputs.dtype}")
        inputs = inputs.to(torch.int64)
        if inputs.numel() and not inputs.is_meta and (int(inputs.min()) < 0 or int(inputs.max()) >= first.num_embeddings):
            raise SpecError("bad_tensor", f"inputs: indices must lie in [0, {first.num_embeddings - 1}] for layer 0 "
                            "(Embedding)")
    else:
        inputs = inputs.to(dtype)
        if not inputs.is_meta and not tensors.all_finite(inputs):
            raise SpecError("bad_tensor", "inputs hold NaN or infinite values")
    if request.options.input_grad and not inputs.dtype.is_floating_point:
        raise SpecError("bad_option", "options.input_grad: the inputs are integer indices (the first layer is "
                        "Embedding), which have no gradient; leave input_grad out")
    if inputs.dim() == 0 or inputs.shape[0] == 0:
        raise SpecError("bad_tensor", f"inputs: expected a batch (first dimension >= 1), got shape {list(inputs.shape)}")
    out = _output_on_meta(spec_key, request, meta, inputs, limits.max_elements)
    terms = _terms(request)
    targets = _targets(request, terms, out, dtype, limits.max_elements, shape_only)
    _refuse_own_loss_split(request.options, terms, inputs.shape[0])
    rows = _rows_per_example(request.options, Batch.of(inputs), out, (0, 1))
    names = facts.names
    frozen = _check_options(request.options, config, inputs.shape[0], len(meta), names)
    _check_hvp(request.options, meta, frozen)
    _check_batch_statistics(request.options, meta, inputs.shape[0], facts.mixing)
    weights = _weights(request, facts, dtype, limits.max_elements)
    parameter_count = facts.parameter_count
    reuse_key = None
    if str(device) == "meta":
        model = meta
    else:
        # The model gets its values: the request's weights over the seeded default initialisation, which
        # is computed once per (layers, dtype, seed) and kept (seconds for large models). Every entry of the
        # state_dict is written, so a model reused from an earlier request of this spec keeps nothing of it.
        state = {} if set(weights) == set(facts.state) else _initial_state(spec_key, request, dtype, config)
        reuse_key = (spec_key, dtype, str(device))
        model = _checkout_model(reuse_key) or build(request.model.layers, limits=limits,
                                                     device="meta").to(dtype).to_empty(device=device)
        model.load_state_dict({**state, **weights})
        inputs = inputs.to(device)
        targets = {k: v.to(device) for k, v in targets.items()}
    return Prepared(model=model, dtype=dtype, inputs=Batch.of(inputs), targets=targets, terms=terms,
                    output_shape=list(out.shape), parameter_count=parameter_count, options=request.options,
                    frozen=frozen, reuse_key=reuse_key, rows_per_example=rows)


def _input_values(value, names: list[str], *, what: str) -> list[tuple[str, object]]:
    """`inputs` as (name, wire value) in `forward`'s order: one tensor, a list of tensor objects (the
    positional arguments) or an object of named tensors (the keyword arguments), for the `names` the model
    takes. A bare nested list is one tensor."""
    takes = f"{what} takes {len(names)} input{'s' if len(names) != 1 else ''} ({', '.join(names)})"
    if value is None:
        raise SpecError("bad_tensor", f"inputs: missing; {takes}", where="inputs")
    if isinstance(value, dict) and not is_tensor(value):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise SpecError("bad_tensor", f"inputs: {unknown[0]!r} is not an input of the model; {takes}",
                            where=f"inputs.{unknown[0]}"[:200], inputs=names)
        missing = [n for n in names if n not in value]
        if missing:
            raise SpecError("bad_tensor", f"inputs: {missing[0]!r} is missing; {takes}, by name",
                            where=f"inputs.{missing[0]}", inputs=names)
        return [(f"inputs.{n}", value[n]) for n in names]
    if isinstance(value, list) and value and all(is_tensor(v) for v in value):
        if len(value) != len(names):
            raise SpecError("bad_tensor", f"inputs: a list of {len(value)} tensors, but {takes}; send them in that "
                            "order, or as an object by name", where="inputs", inputs=names)
        return [(f"inputs[{i}]", v) for i, v in enumerate(value)]
    if len(names) != 1:
        raise SpecError("bad_tensor", f"inputs: one tensor, but {takes}; send a list of tensors in that order, or an "
                        "object of named tensors", where="inputs", inputs=names)
    return [("inputs", value)]


def _as_tensor_value(value, where: str):
    """A tensor object inside an untyped field (a plain dict) as the wire Struct."""
    if isinstance(value, dict):
        try:
            return msgspec.convert(value, Tensor)
        except msgspec.ValidationError as exc:
            raise SpecError("bad_tensor", f"{where}: {exc}", where=where) from None
    return value


# A CPU worker keeps the models it built, per (spec, dtype, device), and reuses one for the next request of
# the same spec: building a model (module construction, default init on meta, storage) is most of a small
# job's worker time (seed [A]: ~0.6 of 1.1 ms, bench/summary.py). A model is checked out exclusively
# (prepare) and handed back after a successful compute (release_model), so two computes never share one.
# What a request could leave in it is reset by prepare: every state_dict entry is loaded, requires_grad is
# set per request (compute._trainable), the memory hooks are removed as they finish; a model with state
# outside its state_dict (non-persistent buffers) is never kept. CUDA models are not kept: they would hold
# device memory across jobs and show in the next job's allocator peak.
_built: OrderedDict[tuple, nn.Module] = OrderedDict()
_built_lock = threading.Lock()
BUILT_MODELS = 16
BUILT_MODEL_MAX_BYTES = 64 << 20


def _checkout_model(key: tuple) -> nn.Module | None:
    with _built_lock:
        return _built.pop(key, None)


def release_model(prep: Prepared) -> None:
    """Hands a worker's model back for the next request of its spec (after compute() succeeded)."""
    key, model = prep.reuse_key, prep.model
    if key is None or not key[2].startswith("cpu"):
        return
    state = model.state_dict()
    if len(state) != sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers()):
        return  # non-persistent buffers: state load_state_dict would not reset
    if sum(t.numel() * t.element_size() for t in state.values()) > BUILT_MODEL_MAX_BYTES:
        return
    prep.reuse_key = None
    with _built_lock:
        _built[key] = model
        _built.move_to_end(key)
        while len(_built) > BUILT_MODELS:
            _built.popitem(last=False)


# The caches below are shared by every thread of the process (the API validates requests from a thread
# pool), so each is read, reordered and evicted only under its lock; the work that fills a miss runs
# outside it, and two threads missing the same key at once both compute it (the second write wins).
_meta_cache: OrderedDict[tuple, tuple[nn.Sequential, "_Facts"]] = OrderedDict()
_meta_lock = threading.Lock()
META_CACHE_ENTRIES = 256


@dataclass(frozen=True)
class _Facts:
    """What the checks read of a spec's meta model, taken once with it (walking the modules costs ~0.1 ms
    a request, a third of a cached POST /estimate)."""

    first: nn.Module  # the first leaf module
    names: list[str]  # parameter names, in order
    state: dict[str, torch.Tensor]  # state_dict: name -> meta tensor
    parameter_count: int
    mixing: list[tuple[str, nn.Module]]  # leaves that mix a batch (BatchNorm in training mode)


def _meta_model(spec_key: bytes, request: GradientRequest, dtype: torch.dtype,
                limits: Limits) -> tuple[nn.Sequential, _Facts]:
    """The spec's model on meta, built once per (spec, dtype, limits): building it costs ~0.3 ms even for a
    small net (module construction and default init, meaningless on meta), on every request the API checks.
    Shared: a caller of prepare(device="meta") reads prep.model, never changes it (estimate() copies it)."""
    key = (spec_key, dtype, limits)
    with _meta_lock:
        hit = _meta_cache.get(key)
        if hit is not None:
            _meta_cache.move_to_end(key)
    if hit is None:
        model = build(request.model.layers, limits=limits, device="meta").to(dtype)
        facts = _Facts(first=next(m for _, m in model.named_modules() if not list(m.children())),
                       names=[n for n, _ in model.named_parameters()], state=model.state_dict(),
                       parameter_count=sum(p.numel() for p in model.parameters()), mixing=_batch_stat_leaves(model))
        hit = (model, facts)
        with _meta_lock:
            _meta_cache[key] = hit
            while len(_meta_cache) > META_CACHE_ENTRIES:
                _meta_cache.popitem(last=False)
    return hit


_shape_cache: OrderedDict[tuple, tuple[torch.Size, torch.dtype]] = OrderedDict()
_shape_lock = threading.Lock()
SHAPE_CACHE_ENTRIES = 512


def _output_on_meta(spec_key: bytes, request: GradientRequest, meta: nn.Sequential, inputs: torch.Tensor,
                    max_elements: int) -> torch.Tensor:
    """The model's output for `inputs`, as a meta tensor, after check_shapes named any layer that cannot
    take its input. A spec that passed once for an input shape passes again: the result is cached, since
    the meta forward (torch's Python decompositions) costs ~2 ms even for a small net, on every request."""
    key = (spec_key, request.model.dtype, tuple(inputs.shape), inputs.dtype)
    with _shape_lock:
        hit = _shape_cache.get(key)
        if hit is not None:
            _shape_cache.move_to_end(key)
    if hit is None:
        out = check_shapes(meta, inputs.to("meta"), max_elements=max_elements)
        hit = (out.shape, out.dtype)
        with _shape_lock:
            _shape_cache[key] = hit
            while len(_shape_cache) > SHAPE_CACHE_ENTRIES:
                _shape_cache.popitem(last=False)
    return torch.empty(hit[0], dtype=hit[1], device="meta")


_init_cache: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
_init_lock = threading.Lock()
# Seeding and building run under their own lock: torch.manual_seed sets the process-wide generator, so two
# threads building at once would draw each other's numbers and get wrong initial weights.
_seed_lock = threading.Lock()


def _initial_state(spec_key: bytes, request: GradientRequest, dtype: torch.dtype, config: EngineConfig) -> dict[str, torch.Tensor]:
    """The state_dict of `torch.manual_seed(seed); nn.Sequential(...).to(dtype)`, from an LRU cache
    bounded by config.init_cache_bytes. Callers copy it into their own model, never share it."""
    key = (spec_key, str(dtype), request.model.seed)
    with _init_lock:
        state = _init_cache.get(key)
        if state is not None:
            _init_cache.move_to_end(key)
            return state
    with _seed_lock:
        torch.manual_seed(request.model.seed)
        state = build(request.model.layers, limits=config.limits, device="cpu").to(dtype).state_dict()
    size = sum(t.numel() * t.element_size() for t in state.values())
    if size <= config.init_cache_bytes // 2:
        with _init_lock:
            _init_cache[key] = state
            while sum(t.numel() * t.element_size() for st in _init_cache.values() for t in st.values()) > \
                    config.init_cache_bytes:
                _init_cache.popitem(last=False)
    return state


def batch_chunks(n: int, micro_batch: int | None) -> list[tuple[int, int]]:
    size = n if not micro_batch else min(micro_batch, n)
    return [(i, min(i + size, n)) for i in range(0, n, size)] if n else [(0, 0)]



def config_from_settings(settings) -> EngineConfig:
    """The engine's limits from the process's Settings (passed in; the engine reads no environment)."""
    return EngineConfig(
        limits=Limits(max_parameters=settings.max_parameters, max_layers=settings.max_layers,
                      max_depth=settings.max_depth, max_elements=settings.max_elements,
                      max_graph_nodes=settings.max_graph_nodes,
                      max_graph_intermediate_bytes=settings.max_job_bytes),
        numcheck_exact_max=settings.numcheck_exact_max,
        numcheck_samples=settings.numcheck_samples,
        numcheck_directions=settings.numcheck_directions,
        numcheck_budget=settings.numcheck_budget,
        numcheck_budget_min_s=settings.numcheck_budget_min_s,
    )


# --- graph models ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class GraphTemplate:
    """A graph validated once for a dtype: its meta GraphModel (shared: copied before anything mutates
    it), the state it reads, and the nodes that mix the examples of a batch."""

    ref: str
    spec: GraphSpec
    model: nn.Module
    compiled: object  # graph.Compiled: immutable; fresh GraphModels are built from it, not deep-copied
    state: dict[str, torch.Tensor]  # state_dict name -> meta tensor (shape and dtype to expect)
    parameters: frozenset[str]
    users: tuple  # the graph's user inputs (wire.GraphInput), in forward's order
    index_bounds: dict[str, int]  # user input name -> rows of the smallest embedding table its ids index


# (ref, dtype) -> GraphTemplate and (ref, dtype, input shape, input dtype) -> (output shape, dtype).
# Both are LRU: locked, since the API prepares requests from several threads at once.
_templates: LRU[GraphTemplate] = LRU(64)
_graph_shapes: LRU[tuple[torch.Size, torch.dtype, bool]] = LRU(SHAPE_CACHE_ENTRIES)


_REF = re.compile(r"[0-9a-f]{64}")


def _graph_spec(request: GradientRequest, dtype: torch.dtype,
                graphs: GraphResolver | None) -> tuple[str, GraphSpec | None, bytes | None]:
    """(ref, graph, canonical bytes) for model.graph, or model.graph_ref resolved through `graphs`."""
    if request.model.graph is not None:
        try:
            data = hashing.encode(request.model.graph)
        except OverflowError:  # JSON integers have no bound; no op takes one beyond 64 bits
            raise SpecError("bad_option", "model.graph: an integer in the graph lies outside the 64-bit range; "
                            "sizes, dims and other integer arguments must fit in int64") from None
        return hashing.digest(data), request.model.graph, data
    ref = request.model.graph_ref
    if not _REF.fullmatch(ref):
        raise SpecError("graph_not_found", f"model.graph_ref {ref[:80]!r} is not a graph_ref (64 hex digits, as a "
                        "result's graph_ref gives it); send the graph itself as model.graph", graph_ref=ref[:80])
    spec = graphs(ref) if graphs is not None else None
    if spec is None:
        hit = _templates.get((ref, dtype))  # a library caller without a store: the graphs seen here
        spec = hit.spec if hit is not None and graphs is None else None
    if spec is None:
        raise SpecError("graph_not_found", f"model.graph_ref {ref[:80]!r} is not a graph this service knows: it was "
                        "never sent here, or went unused for longer than GRADSVC_GRAPH_TTL_S. Send the graph "
                        "itself as model.graph (the answer carries its graph_ref again)", graph_ref=ref[:80])
    return ref, spec, None


def _graph_template(ref: str, spec: GraphSpec, dtype: torch.dtype, config: EngineConfig) -> GraphTemplate:
    from .graph import build_graph

    key = (ref, dtype)
    hit = _templates.get(key)
    if hit is not None:
        return hit
    model = build_graph(spec, limits=config.limits, device="meta", dtype=dtype)
    users = tuple(inp for inp in spec.inputs if inp.kind == "input")
    if not users:
        raise SpecError("bad_option", "model.graph takes no input; export a module whose forward takes the batch")
    state = dict(model.state_dict(keep_vars=True))
    template = GraphTemplate(ref=ref, spec=spec, model=model, compiled=model._graph, state=state,
                             parameters=frozenset(n for n, _ in model.named_parameters()), users=users,
                             index_bounds=dict(getattr(model, "index_bounds", {})))
    _templates.put(key, template)
    return template


def _fresh(template: GraphTemplate, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """A GraphModel of its own (zero-filled on a device), from the validated graph: ~10x cheaper than
    a deep copy of the template's module tree."""
    from .graph import GraphModel

    return GraphModel(template.compiled, device=device, dtype=dtype)


_mixing: LRU[tuple] = LRU(SHAPE_CACHE_ENTRIES)


def _batch_flow(template: GraphTemplate, dtype: torch.dtype, inputs: Batch) -> tuple[list, tuple[int, int] | None]:
    """((node, op, module path) of the nodes that combine the examples of a batch, where the batch sits in
    the first output): two meta runs of a private copy, once per input signature."""
    from .graph import batch_flow

    key = (template.ref, dtype, inputs.signature)
    hit = _mixing.get(key)
    if hit is None:
        mixing, out = batch_flow(_fresh(template, "meta", dtype), [list(x.shape) for x in inputs.tensors],
                                         batched=list(inputs.batched))
        hit = ([tuple(x) for x in mixing], out)
        _mixing.put(key, hit)
    return hit


def _graph_input(raw, where: str, spec, template: GraphTemplate, dtype: torch.dtype, limits,
                 shape_only: bool) -> torch.Tensor:
    """One user input: floating in the model's dtype; integer (token ids, edge indices) and bool (masks)
    kept as the graph captured them."""
    x = tensors.decode(_as_tensor_value(raw, where), where=where, max_elements=limits.max_elements,
                       shape_only=shape_only)
    want = spec.dtype
    want_dtype = tensors.TORCH_DTYPES.get(want or "", torch.float32)
    if not want_dtype.is_floating_point:
        if x.dtype.is_floating_point:
            raise SpecError("bad_tensor", f"{where}: the graph takes {want} values here (token ids, indices or a "
                            f"mask: input {spec.name!r}), got {str(x.dtype).removeprefix('torch.')}; send {want}",
                            where=where)
        x = x.to(want_dtype)
        rows = template.index_bounds.get(spec.name)
        if rows is not None and x.numel() and not x.is_meta and (int(x.min()) < 0 or int(x.max()) >= rows):
            raise SpecError("bad_tensor", f"{where}: token ids must lie in [0, {rows - 1}] (the rows of the embedding "
                            f"table they index), got values in [{int(x.min())}, {int(x.max())}]", rows=rows,
                            where=where)
    else:
        x = x.to(dtype)
        if not x.is_meta and not tensors.all_finite(x):
            raise SpecError("bad_tensor", f"{where} holds NaN or infinite values", where=where)
    return x


def _graph_inputs(request: GradientRequest, template: GraphTemplate, dtype: torch.dtype, limits,
                  shape_only: bool) -> Batch:
    """The request's inputs matched to the graph's (by position or by name), each checked; the batched
    ones (the graph's batch_dim 0) must agree on the batch size."""
    users = template.users
    names = [u.name for u in users]
    values = _input_values(request.inputs, names, what="the graph")
    xs = tuple(_graph_input(raw, where, spec, template, dtype, limits, shape_only)
               for (where, raw), spec in zip(values, users))
    batched = tuple(u.batch_dim == 0 for u in users)
    rows = None
    for (where, _), x, b in zip(values, xs, batched):
        if not b:
            continue
        if x.dim() == 0 or x.shape[0] == 0:
            raise SpecError("bad_tensor", f"{where}: expected a batch (first dimension >= 1), got shape "
                            f"{list(x.shape)}", where=where)
        if rows is None:
            rows = (where, int(x.shape[0]))
        elif int(x.shape[0]) != rows[1]:
            raise SpecError("bad_tensor", f"{where}: batch size {int(x.shape[0])} differs from {rows[0]}'s "
                            f"{rows[1]}; every batched input has one row per example along dim 0", where=where)
    return Batch(xs, batched, tuple(names))


def _graph_output(template: GraphTemplate, dtype: torch.dtype, inputs: Batch, limits,
                  math_attention: bool = False) -> torch.Tensor:
    """The graph's first output for `inputs`, as a meta tensor; check_graph_shapes ran once per input
    signature (on a private copy of the shared model: a run writes its program cache)."""
    from .graph import check_graph_shapes

    key = (template.ref, dtype, inputs.signature, math_attention)
    hit = _graph_shapes.get(key)
    if hit is None:
        out = check_graph_shapes(_fresh(template, "meta", dtype), *[x.to("meta") for x in inputs.tensors],
                                 limits=limits, math_attention=math_attention)
        hit = (out.shape, out.dtype, out.requires_grad)
        _graph_shapes.put(key, hit)
    shape, out_dtype, requires_grad = hit
    _check_differentiable(template, out_dtype, requires_grad)
    return torch.empty(shape, dtype=out_dtype, device="meta")


def _check_differentiable(template: GraphTemplate, out_dtype: torch.dtype, requires_grad: bool) -> None:
    """The loss differentiates the first output: one of integers (argmax, a comparison) or one cut off from
    every parameter (aten.detach last, a no_grad region) has no gradient; else the worker's backward fails."""
    last = _output_producer(template)
    where = f" (made by node {last.name!r}, {last.op.name}{f' in module {last.module!r}' if last.module else ''})" \
        if last is not None else ""
    if not out_dtype.is_floating_point:
        name = str(out_dtype).removeprefix("torch.")
        raise SpecError("no_gradient", f"model.graph: the first output is a tensor of dtype {name}{where}, which has no "
                        "gradient; the loss applies to the first output, so return the floating-point logits or "
                        "loss first (and argmax or compare after the service call)", output_dtype=name,
                        node=last.name if last is not None else None)
    if not requires_grad:
        raise SpecError("no_gradient", f"model.graph: the first output{where} does not depend on any parameter "
                        "through a differentiable path (it is detached, or computed under no_grad), so it has no "
                        "gradient; return the output before .detach() or torch.no_grad()",
                        node=last.name if last is not None else None)


def _output_producer(template: GraphTemplate):
    """The step whose value is the graph's first output (None when it is an input)."""
    first = template.spec.outputs[0] if template.spec.outputs else None
    name = first.get("node") if isinstance(first, dict) else None
    return next((s for s in template.compiled.steps if s.name == name), None)


def _graph_weights(request: GradientRequest, template: GraphTemplate, dtype: torch.dtype,
                   max_elements: int) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, by state_dict name: a graph has no initialiser to fill a gap."""
    given = request.model.weights or {}
    state = template.state
    for name in given:
        if name not in state:
            raise SpecError("bad_weights", f"weights: {name!r} is not a parameter or buffer of the graph; it reads "
                            f"{sorted(state)[:12]}{' ...' if len(state) > 12 else ''}", parameter=name)
    for name in state:
        if name not in given:
            kind = "parameter" if name in template.parameters else "buffer"
            raise SpecError("bad_weights", f"weights: {kind} {name!r} is missing. A graph model has no default "
                            "initialisation (the seeded init exists for layer specs only): send every parameter and "
                            "buffer the graph's inputs name, under that name (named_parameters() and named_buffers(), "
                            "non-persistent buffers included)", parameter=name)
    return _decode_weights(given, state, template.parameters, dtype, max_elements, "the graph")


def _check_graph_options(opts: Options, template: GraphTemplate, dtype: torch.dtype, inputs: Batch) -> None:
    """Options that cannot mean for this graph what they mean for a layer spec, refused before the queue."""
    if opts.checkpoint_segments is not None:
        raise SpecError("bad_option", "options.checkpoint_segments splits a layer spec's top-level layers; a graph "
                        "model has none, so it cannot apply. Remove it (or checkpoint inside the module before "
                        "export)")
    if opts.input_grad:
        floating = inputs.floating()
        if not floating:
            x = inputs.first
            raise SpecError("bad_option", f"options.input_grad: the inputs are integer {str(x.dtype)[6:]} (token "
                            "ids), which have no gradient; leave input_grad out")
        if len(floating) > 1:
            raise SpecError("bad_option", f"options.input_grad: the model takes {len(floating)} floating inputs "
                            f"({', '.join(inputs.names[i] for i in floating)}); input_grad returns the gradient of "
                            "one input tensor. Leave it out, or export a model with one floating input")
    if opts.micro_batch is not None and opts.micro_batch < inputs.rows:
        check_graph_split(template, dtype, inputs, "options.micro_batch")
    if opts.per_sample != "off":
        check_graph_split(template, dtype, inputs, "options.per_sample")


def check_graph_split(template: GraphTemplate, dtype: torch.dtype, inputs: Batch, option: str, *,
                      across_jobs: bool = False) -> None:
    """Refuses `option` (which splits the batch) when a node mixes the batch's examples; `across_jobs`
    (options.shards) also when it draws dropout masks, which every shard would seed alike."""
    mixing, _ = _batch_flow(template, dtype, inputs)
    if mixing:
        node, op, module = mixing[0]
        where = f"module {module!r}" if module else "the root module"
        raise SpecError("bad_option", f"{option}: node {node!r} ({op}) in {where} combines the examples of a batch "
                        f"(batch statistics), so a part of the batch does not give its share of the batch's "
                        f"gradient; remove {option}, or put that module in eval mode before export",
                        node=node, op=op, module=module)
    if across_jobs:
        from .graph import draws_masks

        random = next((s for s in template.compiled.steps if draws_masks(s)), None)
        if random is not None:
            raise SpecError("bad_option", f"{option}: node {random.name!r} ({random.op.name}) in module "
                            f"{random.module!r} draws dropout masks from model.seed, which every shard would repeat; "
                            f"set shards=1 (micro_batch bounds memory), or export in eval mode",
                            node=random.name, module=random.module)


def _prepare_graph(request: GradientRequest, config: EngineConfig, device: str | torch.device, dtype: torch.dtype,
                   *, shape_only: bool, graphs: GraphResolver | None) -> Prepared:
    """prepare() for model.graph / model.graph_ref: the same checks as a layer spec's, then the graph's own."""
    limits = config.limits
    ref, spec, data = _graph_spec(request, dtype, graphs)
    template = _graph_template(ref, spec, dtype, config)
    inputs = _graph_inputs(request, template, dtype, limits, shape_only)
    out = _graph_output(template, dtype, inputs, limits, math_attention=request.options.hvp is not None)
    terms = _terms(request)
    targets = _targets(request, terms, out, dtype, limits.max_elements, shape_only)
    _refuse_own_loss_split(request.options, terms, inputs.rows)
    _check_graph_options(request.options, template, dtype, inputs)
    if "options.shards" in _splits(request.options, inputs.rows):  # what mixes is the clearer reason
        check_graph_split(template, dtype, inputs, "options.shards", across_jobs=True)
    maybe_split = _splits(request.options, inputs.rows) or request.options.shards == "auto"
    out_batch = _batch_flow(template, dtype, inputs)[1] if maybe_split and any(inputs.batched) else None
    rows = _rows_per_example(request.options, inputs, out, out_batch)
    names = [n for n in template.state if n in template.parameters]
    frozen = _check_options(request.options, config, inputs.rows, 1, names)
    _check_hvp(request.options, template.model, frozen)
    weights = _graph_weights(request, template, dtype, limits.max_elements)
    parameter_count = sum(template.state[n].numel() for n in names)
    if str(device) == "meta" and not shape_only:
        model = template.model  # read, never run or changed, on this path
    else:
        model = _fresh(template, device, dtype)
        if str(device) != "meta":
            model.load_state_dict(weights)
            inputs = inputs.to(device)
            targets = {k: v.to(device) for k, v in targets.items()}
    return Prepared(model=model, dtype=dtype, inputs=inputs, targets=targets, terms=terms,
                    output_shape=list(out.shape), parameter_count=parameter_count, options=request.options,
                    frozen=frozen, graph=template, graph_data=data, rows_per_example=rows)
