"""The model side of prepare() for a layer spec (model.layers): its model built on meta once per spec (the checks
read it), the input decoded and checked, the output's shape found on meta, the splits its layers refuse, its
weights; on a device, the request's weights over the seeded default initialisation, in a model the worker holds from an
earlier request of the spec when it has one (resident.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import msgspec
import torch
from torch import nn

from gradsvc.wire import GradientRequest, Options

from . import resident, tensors
from .config import EngineCaches, EngineConfig, state_bytes
from .decode import as_tensor_value, decode_weights, input_values, per_example_option
from .errors import SpecError
from .prepared import Batch, Prepared
from .spec import Limits, build, validate_shapes, leaves, sequence_first

# Seeding and building run under one lock: torch.manual_seed sets the process-wide generator (torch's own
# process state, whichever Engine asks), so two threads building at once would draw each other's numbers.
_seed_lock = threading.Lock()


class LayerSpecModel:
    """The model side of prepare() for model.layers (prepare.py runs the checks in order)."""

    def __init__(self, request: GradientRequest, config: EngineConfig, caches: EngineCaches,
                 dtype: torch.dtype) -> None:
        self.request, self.config, self.caches, self.dtype = request, config, caches, dtype
        self.spec_key = msgspec.json.encode(request.model.layers)  # the caches are keyed by the spec
        # shared, read-only: the checks read it
        self.meta, self.facts = _meta_model(caches, self.spec_key, request, dtype, config.limits)
        self.top_layers = len(self.meta)
        self.parameter_names = self.facts.names
        self.parameter_count = self.facts.parameter_count
        self.prepared: str | None = None  # after model() on a device: "resident" or "built", and the bytes copied
        self.copied_bytes = 0

    def inputs(self, shape_only: bool) -> Batch:
        """The one input tensor: integer indices for a first Embedding, else floating in the model's dtype."""
        request, dtype = self.request, self.dtype
        raw = as_tensor_value(input_values(request.inputs, ["inputs"], what="a layer spec")[0][1], "inputs")
        inputs = tensors.decode(raw, where="inputs", max_elements=self.config.limits.max_elements,
                                shape_only=shape_only)
        first = self.facts.first
        if isinstance(first, nn.Embedding):
            if inputs.dtype.is_floating_point or inputs.dtype == torch.bool:
                raise SpecError("bad_tensor", "inputs: the first layer is Embedding, which takes integer indices; "
                                f"got {inputs.dtype}")
            inputs = inputs.to(torch.int64)
            if inputs.numel() and not inputs.is_meta and \
                    (int(inputs.min()) < 0 or int(inputs.max()) >= first.num_embeddings):
                raise SpecError("bad_tensor", f"inputs: indices must lie in [0, {first.num_embeddings - 1}] for "
                                "layer 0 (Embedding)")
        else:
            inputs = inputs.to(dtype)
            if not inputs.is_meta and not tensors.all_finite(inputs):
                raise SpecError("bad_tensor", "inputs hold NaN or infinite values")
        if request.options.input_grad and not inputs.dtype.is_floating_point:
            raise SpecError("bad_option", "options.input_grad: the inputs are integer indices (the first layer is "
                            "Embedding), which have no gradient; leave input_grad out")
        if inputs.dim() == 0 or inputs.shape[0] == 0:
            raise SpecError("bad_tensor", f"inputs: expected a batch (first dimension >= 1), got shape "
                            f"{list(inputs.shape)}")
        return Batch.of(inputs)

    def output(self, inputs: Batch) -> torch.Tensor:
        return _output_on_meta(self.caches, self.spec_key, self.request, self.meta, inputs.first,
                               self.config.limits.max_elements)

    def validate_splits(self, opts: Options, inputs: Batch) -> None:
        """A layer spec's splits are checked with its layers (validate_batch_statistics), after the options."""

    def output_batch(self, opts: Options, inputs: Batch, split: bool = False) -> tuple[int, int]:
        return (0, 1)  # a stack of layers keeps the batch in dim 0, one output row per example

    def validate_batch_statistics(self, opts: Options, inputs: Batch) -> None:
        _validate_batch_statistics(opts, self.meta, inputs.rows, self.facts.mixing)

    def model(self, device: str | torch.device, shape_only: bool, scope: str | None = None) -> tuple[nn.Module, tuple | None]:
        """(the model on `device`, (the key it goes back to the pool under, its Resident)), the weights decoded and
        checked first: on meta the shared meta model (every weight decoded and checked); elsewhere the request's
        weights over the seeded default initialisation (computed once per (layers, dtype, seed) and kept: seconds for
        large models), in a model the worker holds from an earlier request of this spec and `scope` when there is
        one (resident.py: only what is not in place is decoded, checked and copied in). Every state entry not in
        place is written, so a model held from an earlier request keeps nothing of it."""
        request, dtype, caches, facts = self.request, self.dtype, self.caches, self.facts
        max_elements = self.config.limits.max_elements
        if str(device) == "meta":
            _weights(request, facts, dtype, max_elements)
            return self.meta, None
        given = _given(request, facts)
        key = (self.spec_key, dtype, str(device), scope)
        keep = resident.keeps(device, self.config)
        held, hit = resident.checkout(caches, key, lambda: _resident(request, self.config, dtype, device, facts)) \
            if keep else (_resident(request, self.config, dtype, device, facts), False)
        seed = ("seed", request.model.seed)
        identities = {n: resident.identity(given[n]) if n in given else seed for n in facts.state}
        in_place = held.in_place(identities)
        stale = [n for n in facts.state if n not in in_place]
        resident.refuse_unresolved(given, stale)
        init = _initial_state(caches, self.spec_key, request, dtype, self.config) \
            if any(n not in given for n in stale) else {}
        params = set(facts.names)

        def decode(names: list[str]) -> dict[str, torch.Tensor]:
            out = decode_weights({n: given[n] for n in names if n in given}, facts.state, params, dtype, max_elements,
                                 "the model")
            return {n: out[n] if n in out else init[n] for n in names}

        staging = resident.staging_for(caches, device)
        sizes = {n: t.numel() * t.element_size() for n, t in facts.state.items()}
        copied = resident.load_grouped(held, stale, decode, identities, staging, sizes)
        self.prepared, self.copied_bytes = ("resident" if hit else "built"), copied
        return held.model, ((key, held) if keep else None)


def _given(request: GradientRequest, facts: "_Facts") -> dict:
    """The request's wire weights, once each name is the model's and, when any is given, every parameter is."""
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
    return given


def _resident(request: GradientRequest, config: EngineConfig, dtype: torch.dtype, device, facts: "_Facts"):
    """A new model for the spec on `device` (zero-filled: every entry is loaded next), as a Resident."""
    model = build(request.model.layers, limits=config.limits, device="meta").to(dtype).to_empty(device=device)
    plain, keep = load_facts(model)
    return resident.Resident(model, frozenset(facts.names), plain=plain, keep=keep)


def _validate_batch_statistics(opts: Options, model: nn.Module, batch: int,
                            mixing: list[tuple[str, nn.Module]] | None = None) -> None:
    """micro_batch and per_sample split the batch. A layer that mixes the examples of a batch
    (BatchNorm in training mode: it normalises with the batch's mean and variance) makes either
    inexact, so both are refused here, before the queue, rather than answered with other gradients."""
    example = per_example_option(opts)
    splits = example or (opts.micro_batch is not None and opts.micro_batch < batch)
    option = example or "options.micro_batch"
    hit = sequence_first(model) if splits else None
    if hit:
        raise SpecError("bad_option", f"{option}: layer {hit[0]} ({type(hit[1]).__name__}) takes (sequence, batch, "
                        "...) with batch_first=false, and the batch is split along dim 0; set batch_first=true "
                        f"(and send batch-first inputs) or leave {option} out", layer=hit[0])
    if example:
        for name, module in model.named_modules():
            if isinstance(module, nn.RNNBase) or (isinstance(module, nn.Embedding) and module.max_norm is not None):
                raise SpecError("bad_option", f"{example}: layer {name} ({type(module).__name__}) cannot "
                                "run under torch.func.vmap, which per-example gradients use (recurrent layers, "
                                f"Embedding with max_norm); {_without(example)}", layer=name)
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
    if example:
        raise SpecError("bad_option", f"{example}: layer {name} ({kind}) mixes the samples of a batch in "
                        f"training mode, so per-example gradients are undefined; remove it or {_without(example)}",
                        layer=name, option=example.split(" ")[0].removeprefix("options."))


def _without(option: str) -> str:
    """How to drop the option that asked for per-example gradients."""
    return "set per_sample='off'" if option == "options.per_sample" else f"leave {option} out"


def _batch_stat_leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in leaves(model) if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]



def _weights(request: GradientRequest, facts: "_Facts", dtype: torch.dtype, max_elements: int) -> dict[str, torch.Tensor]:
    return decode_weights(_given(request, facts), facts.state, set(facts.names), dtype, max_elements, "the model")



# Modules whose _load_from_state_dict, given every key of their state, copies each one in place as nn.Module's does
# (_NormBase adds only a default for a missing num_batches_tracked).
_PLAIN_LOAD = (nn.Module._load_from_state_dict, nn.modules.batchnorm._NormBase._load_from_state_dict)


def load_facts(model: nn.Module) -> tuple[bool, bool]:
    """(plain, keep) of a model built for a spec, found once when it is built: `plain` when every module loads as
    nn.Module does (no load hooks, no override of its own), so prepare copies each entry in place instead of walking
    the modules through load_state_dict on every request (the 6-8-3 tanh net's compute in process: 1.04 -> 0.89 ms);
    `keep` when it holds no state outside its state_dict (non-persistent buffers, which loading would not reset),
    so it may be held for the next request."""
    state = model.state_dict(keep_vars=True)
    keep = len(state) == sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    plain = all(type(m)._load_from_state_dict in _PLAIN_LOAD and not m._load_state_dict_pre_hooks
                and not m._load_state_dict_post_hooks for m in model.modules())
    return plain, keep


@dataclass(frozen=True)
class _Facts:
    """What the checks read of a spec's meta model, taken once with it (walking the modules costs ~0.1 ms
    a request, a third of a cached POST /estimate)."""

    first: nn.Module  # the first leaf module
    names: list[str]  # parameter names, in order
    state: dict[str, torch.Tensor]  # state_dict: name -> meta tensor
    parameter_count: int
    mixing: list[tuple[str, nn.Module]]  # leaves that mix a batch (BatchNorm in training mode)



def _meta_model(caches: EngineCaches, spec_key: bytes, request: GradientRequest, dtype: torch.dtype,
                limits: Limits) -> tuple[nn.Sequential, _Facts]:
    """The spec's model on meta, built once per (spec, dtype, limits): building it costs ~0.3 ms even for a
    small net (module construction and default init, meaningless on meta), on every request the API checks.
    Shared: a caller of prepare(device="meta") reads prep.model, never changes it (estimate() copies it)."""
    key = (spec_key, dtype, limits)
    hit = caches.meta_models.get(key)
    if hit is None:
        model = build(request.model.layers, limits=limits, device="meta").to(dtype)
        facts = _Facts(first=next(m for _, m in model.named_modules() if not list(m.children())),
                       names=[n for n, _ in model.named_parameters()], state=model.state_dict(),
                       parameter_count=sum(p.numel() for p in model.parameters()), mixing=_batch_stat_leaves(model))
        hit = (model, facts)
        caches.meta_models.put(key, hit)
    return hit


def _output_on_meta(caches: EngineCaches, spec_key: bytes, request: GradientRequest, meta: nn.Sequential,
                    inputs: torch.Tensor, max_elements: int) -> torch.Tensor:
    """The model's output for `inputs`, as a meta tensor, after validate_shapes named any layer that cannot
    take its input. A spec that passed once for an input shape passes again: the result is cached, since
    the meta forward (torch's Python decompositions) costs ~2 ms even for a small net, on every request."""
    key = (spec_key, request.model.dtype, tuple(inputs.shape), inputs.dtype)
    hit = caches.output_shapes.get(key)
    if hit is None:
        out = validate_shapes(meta, inputs.to("meta"), max_elements=max_elements)
        hit = (out.shape, out.dtype)
        caches.output_shapes.put(key, hit)
    return torch.empty(hit[0], dtype=hit[1], device="meta")


def _initial_state(caches: EngineCaches, spec_key: bytes, request: GradientRequest, dtype: torch.dtype,
                   config: EngineConfig) -> dict[str, torch.Tensor]:
    """The state_dict of `torch.manual_seed(seed); nn.Sequential(...).to(dtype)`, kept while it weighs at most
    half of config.init_cache_bytes. Callers copy it into their own model, never share it."""
    key = (spec_key, str(dtype), request.model.seed)
    state = caches.initial_states.get(key)
    if state is not None:
        return state
    with _seed_lock:
        torch.manual_seed(request.model.seed)
        state = build(request.model.layers, limits=config.limits, device="cpu").to(dtype).state_dict()
    if state_bytes(state) <= config.init_cache_bytes // 2:
        caches.initial_states.put(key, state)
    return state
