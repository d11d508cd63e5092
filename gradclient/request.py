"""A gradients/estimate call as the request body the API reads: the model as a layer spec or an exported
graph (kept per structure, sent by graph_ref once the service knows it), its weights inline or by
reference (refs.py), the inputs, targets and options; and what to forget when the service lost a piece."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from gradsvc import wire

from .errors import (
    BadOptionError,
    GradientClientError,
    GraphNotFoundError,
    UnsupportedModuleError,
)
from .refs import INLINE_BYTES, TensorRefs
from .tensors import inputs_to_wire, several_inputs, to_wire

_OPTION_NAMES = frozenset(f.name for f in msgspec.structs.fields(wire.Options))
# The key under which Run.gradients (gradclient/runs.py) hands its `run` to the request with the options.
RUN_OPTION = "_run"
# Exports kept per client; each costs ~1 s of torch.export, so the cache is the point.
_EXPORTS_KEPT = 32


@dataclass(frozen=True)
class Call:
    """One gradients/submit/estimate call's arguments, built once by the public method (which takes them as
    keywords, as docs/sdk.md lists them) and read by the flows (base.py) and RequestBuilder.prepare."""

    model: Any
    inputs: Any
    targets: Any = None
    loss: Any = "cross_entropy"
    losses: list | None = None
    dtype: str | None = None
    seed: int | None = None  # None: drawn once per call (call_seed), so that a resend repeats it
    options: Mapping[str, Any] = field(default_factory=dict)  # the service's options, and the SDK's own keys
    wait_s: float = 30.0  # gradients(): the POST's server-side wait
    timeout: float | None = None  # gradients(): the whole call's deadline
    progress: bool = False  # gradients(): show the job's phase while polling

    @property
    def update_buffers(self) -> bool:
        """gradients(update_buffers=False): an SDK argument among the options, not a service option."""
        return bool(self.options.get("update_buffers", True))

    @property
    def verify(self) -> bool:
        """gradients(verify=True): a recording reused for another batch has its gradients checked again on it (a new
        recording always has them checked before it is sent)."""
        return bool(self.options.get("verify", False))

    @property
    def run(self) -> Any:
        """Run.gradients' step (RUN_OPTION): the body's `run`, not an option."""
        return self.options.get(RUN_OPTION)

    def service_options(self) -> dict[str, Any]:
        """The options the body carries: a fresh dict, without the SDK's own keys."""
        return {k: v for k, v in self.options.items() if k not in ("update_buffers", "verify", RUN_OPTION)}

    def seeded(self) -> "Call":
        """The call with its seed drawn (call_seed) when the caller gave none."""
        return self if self.seed is not None else replace(self, seed=call_seed(self.model))


class Outgoing(msgspec.Struct):
    """One request body, ready to send (and to send again)."""

    body: dict[str, Any]  # encoded when sent (KeptBuffer.encoded), tensors as views of the caller's memory
    encoder: Any
    local_names: dict[str, str]
    graph_key: Any = None  # the export cache's key when the model went as a graph
    by_ref: bool = False  # sent as graph_ref, without the graph
    uploads: list = msgspec.field(default_factory=list)  # (sha256, bytes) of weight pieces to PUT first
    refs: list = msgspec.field(default_factory=list)  # every piece the body names by reference
    sent_bytes: int = 0  # the uploaded pieces' bytes
    body_bytes: int = 0  # the body's, once encoded
    module: Any = None  # the nn.Module sent as a graph: the buffers its forward writes come back into it
    export: Any = None  # its _Export (how it was captured, its output structure)

    @property
    def content(self) -> bytes:
        """The body encoded into fresh bytes."""
        return self.encoder.encode(self.body)


class _Export(msgspec.Struct):
    """One exported graph, cached per module structure and input signature (not per weights)."""

    graph: wire.GraphSpec
    names: list[str]  # its parameters' and buffers' state_dict names, in the graph's order
    ref: str | None = None  # the service's graph_ref, once an answer gave it
    capture: str = "export"  # how it was captured (export.py's _captured): export, export_static, draft, trace
    out_spec: Any = None  # forward's output structure (a torch pytree TreeSpec)
    traced: Any = None  # capture "trace": the recording, whose guards decide whether the next call reuses it
    specialised: Any = None  # what the graph is specialised to (GradientResult.specialised)
    why_not_export: str | None = None  # capture "trace": torch.export's reason (the next capture skips export)
    gradients_verified: bool = False  # capture "trace": its gradients checked against the module's (verify=True)


class _Inline:
    """What changing weights may still put in one request body (refs.py), and the ones it took."""

    def __init__(self) -> None:
        self.left = INLINE_BYTES
        self.taken: set[int] = set()  # id() of the tensors in the body


def _guards_hold(entry: _Export, model: Any, args: tuple, kwargs: dict) -> bool:
    from torch.utils import _pytree as pytree

    from .replay import check_guards

    return check_guards(entry.traced, model, pytree.tree_leaves((args, kwargs)))


def _specialised(exported: Any, args: tuple, kwargs: dict) -> dict | None:
    """What a capture is specialised to: nothing for "export"; the inputs' shapes for "export_static" and
    "draft" (draft also to the branches this call took); the trace's guards (shapes, values read, sizes)."""
    from torch.utils import _pytree as pytree

    if exported.traced is not None:
        return exported.traced.guards.as_dict()
    if exported.capture == "export":
        return None
    return {"inputs": [{"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
                       for x in pytree.tree_leaves((args, kwargs))], "values": {}, "sizes": {}, "constants": []}


class RequestBuilder:
    """Builds a client's request bodies; holds what lasts between them (the exports, the pieces sent)."""

    def __init__(self, wire_format: str, encoder: Any, ref_min_bytes: int | None) -> None:
        self.wire_format = wire_format
        self.encoder = encoder
        self.exports: dict[Any, _Export] = {}
        # A module's weights of at least ref_min_bytes go up once, by reference (refs.py); None: in every body.
        self.refs = TensorRefs(ref_min_bytes) if ref_min_bytes is not None else None

    def prepare(self, call: Call) -> Outgoing:
        """The call's request body: the model's spec (its new weight pieces in `uploads`), inputs, targets,
        loss and options, and Run.gradients' step as the body's `run`."""
        fmt = self.wire_format
        out = Outgoing(body={}, encoder=self.encoder, local_names={})
        options = call.service_options()
        spec = self._model_spec(call.model, call.inputs, options, out, call.verify)
        if call.dtype is not None:
            spec["dtype"] = call.dtype
        spec.setdefault("seed", call.seed)
        out.body.update(model=spec, inputs=inputs_to_wire(call.inputs, fmt), options=self._options(options))
        if call.targets is not None:
            out.body["targets"] = ({k: to_wire(v, fmt) for k, v in call.targets.items()}
                                   if isinstance(call.targets, dict) else to_wire(call.targets, fmt))
        if call.losses is not None:
            out.body["losses"] = call.losses
        else:
            out.body["loss"] = call.loss
        if call.run is not None:
            out.body["run"] = call.run
        out.refs = [r for w in spec.get("weights", {}).values() if isinstance(w, wire.Tensor) and w.refs
                    for r in w.refs]
        return out

    def _model_spec(self, model: Any, inputs: Any, options: dict[str, Any], out: Outgoing,
                    verify: bool = False) -> dict[str, Any]:
        """The body's `model`: a spec dict as given (its weights on the wire), a module the layer spec
        expresses as layers, any other module as its exported graph; `freeze` in the service's names."""
        if isinstance(model, wire.ModelSpec):
            model = msgspec.structs.asdict(model)
        if isinstance(model, dict):
            spec = dict(model)
            weights = spec.pop("weights", None)
            if weights:
                spec["weights"] = {k: to_wire(v, self.wire_format) for k, v in weights.items()}
            return spec
        c = _as_layers(model, inputs)
        if c is None:  # any other nn.Module goes as an exported graph with its weights
            spec = self._graph_spec(model, inputs, out, _Inline(), verify)
            out.module, out.export = model, self.exports[out.graph_key]
            if "freeze" not in options:
                frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
                if frozen:
                    options["freeze"] = frozen
            return spec
        spec = {"layers": c.layers, "dtype": c.dtype}
        if c.weights:
            inline = _Inline()
            spec["weights"] = {k: self._weight(v, out.uploads, inline) for k, v in c.weights.items()}
        out.local_names = c.local_names
        if "freeze" in options:
            options["freeze"] = _service_prefixes(options["freeze"], c.local_names)
        elif c.frozen:
            options["freeze"] = c.frozen
        return spec

    def _weight(self, t: Any, uploads: list, inline: "_Inline") -> Any:
        """A weight as the request carries it: by reference when large (its new pieces into `uploads`), but
        in the body while it trains and changes from call to call (refs.py), up to INLINE_BYTES a request."""
        if self.refs is not None:
            # The parameter itself: its version counter says when it changed. A tied weight named twice
            # goes in the body twice (the second look would find it unchanged).
            size = t.numel() * t.element_size()
            if (id(t) in inline.taken or self.refs.changing(t)) and size <= inline.left:
                inline.left -= size
                inline.taken.add(id(t))
                return to_wire(t.detach(), self.wire_format)
            by_ref = self.refs.wire(t)
            if by_ref is not None:
                value, pending = by_ref
                uploads.extend(pending)
                return value
        return to_wire(t.detach(), self.wire_format)

    def _graph_spec(self, model: Any, inputs: Any, out: Outgoing, inline: "_Inline", verify: bool = False) -> dict[str, Any]:
        """The model spec of a module the layer spec cannot express: its exported graph (or, once the
        service has answered for this structure, the graph's ref) and its current weights; the export
        cache's key and whether the graph went by ref into `out`."""
        from .module_state import state_of

        key, entry = self._export(model, inputs, verify)
        state = state_of(model)  # parameters, buffers, and tensor attributes a recorded forward reads
        weights = {n: self._weight(state[n], out.uploads, inline) for n in entry.names}
        spec: dict[str, Any] = {"dtype": entry.graph.dtype, "weights": weights}
        if entry.ref is not None:
            spec["graph_ref"] = entry.ref
        else:
            spec["graph"] = entry.graph
        out.graph_key, out.by_ref = key, entry.ref is not None
        return spec

    def _export(self, model: Any, inputs: Any, verify: bool = False) -> tuple[Any, "_Export"]:
        """The module's exported graph for these inputs and its key in the cache: found there, else
        exported now (~1 s of torch.export) and kept. A recording (capture "trace") is verified before it is kept:
        its outputs on this batch equal the module's, and with `verify` its gradients too (replay.py)."""
        from torch.utils import _pytree as pytree

        from .export import example_inputs, export_graph
        from .replay import verify_recording

        args, kwargs = example_inputs(inputs)
        rows = next(x.shape[0] for x in pytree.tree_leaves((args, kwargs)))
        key = _structure_key(model, args, kwargs)
        entry = self.exports.get(key)
        if entry is None:  # a model export could not make batch-dynamic is kept per batch size
            entry = self.exports.get((*key, rows))
            key = key if entry is None else (*key, rows)
        because = None
        if entry is not None and entry.traced is not None and not _guards_hold(entry, model, args, kwargs):
            entry, because = None, entry.why_not_export  # its guards broken by this batch: recorded again
        if entry is not None and verify and entry.traced is not None and not entry.gradients_verified:
            verify_recording(entry.traced, model, args, kwargs, gradients=True)
            entry.gradients_verified = True
        if entry is None:
            exported = export_graph(model, args, kwargs, because)  # UnsupportedModuleError with torch's reason
            if exported.traced is not None:  # outputs and gradients, whatever `verify` says (replay.py)
                verify_recording(exported.traced, model, args, kwargs, gradients=True)
                verify = True
            specialised = _specialised(exported, args, kwargs)
            # The graph says how it was captured and its guards: the service echoes them in the result.
            exported.graph.capture = exported.capture
            exported.graph.specialised = None if specialised is None else msgspec.convert(specialised, wire.Specialised)
            entry = _Export(graph=exported.graph, names=list(exported.weights), capture=exported.capture,
                            out_spec=exported.out_spec, traced=exported.traced, specialised=specialised,
                            why_not_export=exported.why_not_export, gradients_verified=verify)
            key = key if exported.dynamic_batch else (*key, rows)
            if exported.capture == "draft":  # a graph of this call's branches, without guards: never reused
                key = (*key, rows, id(entry))
            old = self.exports.get(key)
            if old is not None and old.graph == entry.graph:
                entry.ref = old.ref  # recorded again to the same program: the service holds it already
            if len(self.exports) >= _EXPORTS_KEPT:
                self.exports.pop(next(iter(self.exports)))
            self.exports[key] = entry
        return key, entry

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise BadOptionError(f"unknown option(s) {unknown}; the options are {sorted(_OPTION_NAMES)}",
                                 detail={"options": unknown})
        hvp = options.get("hvp")
        if isinstance(hvp, dict) and isinstance(hvp.get("vector"), dict):
            options["hvp"] = {**hvp, "vector": {k: to_wire(v, self.wire_format) for k, v in hvp["vector"].items()}}
        if self.wire_format == "json":
            options.setdefault("encoding", "b64")  # never nested lists: b64 decodes straight to bytes
        return options

    def remember(self, out: Outgoing, graph_ref: str | None) -> None:
        """After an answer: the next request for this structure sends graph_ref, not the graph."""
        entry = self.exports.get(out.graph_key) if out.graph_key is not None else None
        if entry is not None and graph_ref:
            entry.ref = graph_ref

    def lost(self, out: Outgoing, exc: GradientClientError) -> bool:
        """Whether the request is worth sending again after `exc` (graph_not_found, tensor_not_found): a
        graph sent by ref (the graph goes whole next), or pieces the service lost (they go up again next)."""
        if isinstance(exc, GraphNotFoundError):
            entry = self.exports.get(out.graph_key) if out.graph_key is not None else None
            if entry is None or not out.by_ref:
                return False
            entry.ref = None
            return True
        if out.refs and self.refs is not None:
            self.refs.forget(out.refs)
            return True
        return False


def _as_layers(model: Any, inputs: Any) -> Any:
    """The module as the layer spec (convert.convert's Converted), or None for a module that goes as a graph:
    one called with several inputs (a layer spec takes one tensor), one whose forward may write buffers
    (batch norm in training mode: only a graph's result carries them back), or one of layers the spec lacks."""
    from .convert import convert  # needs torch; spec dicts do not

    if (several_inputs(inputs) or _may_write_buffers(model)) and is_module(model):
        return None
    try:
        return convert(model)
    except UnsupportedModuleError:
        if not is_module(model):
            raise
        return None


def _may_write_buffers(model: Any) -> bool:
    return bool(getattr(model, "training", False)) and any(True for _ in model.buffers())


def _service_prefixes(prefixes: list[str], local_names: dict[str, str]) -> list[str]:
    """`freeze` prefixes given in the local model's names ("fc1") as the service's ("0")."""
    out = []
    for p in prefixes:
        hits = [s for s, loc in local_names.items() if loc == p or loc.startswith(p.rstrip(".") + ".")]
        out.extend(hits or [p])
    return out


def is_module(model: Any) -> bool:
    try:
        from torch import nn
    except ImportError:
        return False
    return isinstance(model, nn.Module)


def _structure_key(model: Any, args: tuple, kwargs: dict) -> tuple:
    """What an export depends on: the module's class and configuration, its tensors' names, shapes,
    dtypes and layouts, train/eval mode, its modules' forward hooks (export traces them), and each input's name, dtype
    and shape (past the batch dimension for the batched ones: export makes it dynamic). Not the weights'
    values: those go with every request."""
    from torch.utils import _pytree as pytree

    from .export import batched_inputs

    named = list(model.named_modules())  # one walk for all of it (a walk each: 5.5 -> 4 ms for 377 modules)
    tensors = tuple((n, tuple(t.shape), str(t.dtype), str(t.layout)) for n, t in _named_tensors(named))
    modes = tuple(m.training for _, m in named)
    xs, tree = pytree.tree_flatten((args, kwargs))
    attributes = tuple(_plain_attributes(m) for _, m in named)
    shapes = tuple((str(x.dtype), str(x.layout), tuple(x.shape[1:]) if b else tuple(x.shape), b)
                   for x, b in zip(xs, batched_inputs(xs)))
    hooks = tuple((*m._forward_pre_hooks.values(), *m._forward_hooks.values()) for _, m in named)
    return (type(model), repr(model), tensors, modes, tuple(kwargs), str(tree), shapes, attributes, hooks)


def _named_tensors(named: list) -> list:
    """named_parameters() then named_buffers() of the module whose named_modules() is `named`, in their order
    (each tensor once, under its first name), from that one walk."""
    out = []
    for kind in ("_parameters", "_buffers"):
        seen = set()
        for prefix, m in named:
            for n, t in getattr(m, kind).items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((f"{prefix}.{n}" if prefix else n, t))
    return out


_PLAIN = (int, float, bool, str, type(None))


def _plain_attributes(module: Any) -> tuple:
    """A module's own public attributes that forward may read and repr() does not show: numbers, strings
    and flags by value, classes and functions (a custom autograd Function it applies) by name."""
    import torch

    out = []
    for k, v in vars(module).items():
        if k.startswith("_") or isinstance(v, (torch.Tensor, torch.nn.Module)):
            continue
        if isinstance(v, _PLAIN):
            out.append((k, v))
        elif isinstance(v, type) or callable(v):
            out.append((k, f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', type(v).__qualname__)}"))
        else:
            out.append((k, type(v).__qualname__))
    return tuple(out)


def call_seed(model: Any) -> int:
    """A module's call draws its seed (its dropout masks) from torch's global generator, as a local
    training step would draw its masks: `torch.manual_seed` makes a whole run reproducible. A spec dict
    keeps seed 0 (for a layer spec without weights it also seeds the initial weights)."""
    if not is_module(model):
        return 0
    import torch

    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))


__all__ = ["Call", "Outgoing", "RequestBuilder", "call_seed", "is_module"]
