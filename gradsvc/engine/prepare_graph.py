"""The model side of prepare() for a graph (model.graph, or model.graph_ref resolved through the caller's store):
the graph validated once per (ref, dtype) into a GraphTemplate, the inputs matched to the graph's and checked,
the output's shape and the batch flow found on meta once per input signature, the options a graph cannot
honour, its weights; on a device, a GraphModel of its own gets the request's weights."""

from __future__ import annotations

import re

import torch
from torch import nn

from gradsvc import hashing, wire
from gradsvc.wire import GradientRequest, GraphSpec, Options

from . import outputs, resident, tensors
from .config import EngineCaches, EngineConfig
from .decode import (as_tensor_value, check_by_reference, decode_weights, input_values, loss_terms, per_example_option,
                     splits)
from .errors import SpecError
from .graph import sparse
from .graph.batch_flow import batch_flow, draws_masks
from .graph.compiler import build_graph
from .graph.interpreter import GraphModel, sharing
from .graph.meta_check import validate_graph_shapes
from .losses import OWN_LOSS
from .prepared import Batch, GraphResolver, GraphTemplate

_REF = re.compile(r"[0-9a-f]{64}")


def _graph_spec(caches: EngineCaches, request: GradientRequest, dtype: torch.dtype,
                graphs: GraphResolver | None) -> tuple[str, GraphSpec | None, bytes | None]:
    """(ref, graph, canonical bytes) for model.graph, or model.graph_ref resolved through `graphs`."""
    if request.model.graph is not None:
        try:
            data = hashing.encode(request.model.graph)
        except OverflowError:  # JSON integers have no bound; no op takes one beyond 64 bits
            raise SpecError("bad_option", "model.graph: an integer in the graph lies outside the 64-bit range; "
                            "sizes, dims and other integer arguments must fit in int64") from None
        wire.owned(request.model.graph.constants)  # the graph outlives the request (graph_templates)
        return hashing.digest(data), request.model.graph, data
    ref = request.model.graph_ref
    if not _REF.fullmatch(ref):
        raise SpecError("graph_not_found", f"model.graph_ref {ref[:80]!r} is not a graph_ref (64 hex digits, as a "
                        "result's graph_ref gives it); send the graph itself as model.graph", graph_ref=ref[:80])
    spec = graphs(ref) if graphs is not None else None
    if spec is None:
        hit = caches.graph_templates.get((ref, dtype))  # a library caller without a store: the graphs seen here
        spec = hit.spec if hit is not None and graphs is None else None
    if spec is None:
        raise SpecError("graph_not_found", f"model.graph_ref {ref[:80]!r} is not a graph this service knows: it was "
                        "never sent here, or went unused for longer than GRADSVC_GRAPH_TTL_S. Send the graph "
                        "itself as model.graph (the answer carries its graph_ref again)", graph_ref=ref[:80])
    return ref, spec, None


def _graph_template(caches: EngineCaches, ref: str, spec: GraphSpec, dtype: torch.dtype,
                    config: EngineConfig, first_output: int = 0) -> GraphTemplate:
    key = (ref, dtype) if first_output == 0 else (ref, dtype, first_output)
    hit = caches.graph_templates.get(key)
    if hit is not None:
        return hit
    if first_output:
        spec = outputs.loss_first(spec, first_output)
    model = build_graph(spec, limits=config.limits, device="meta", dtype=dtype)
    users = tuple(inp for inp in spec.inputs if inp.kind == "input")
    if not users:
        raise SpecError("bad_option", "model.graph takes no input; export a module whose forward takes the batch")
    state = dict(model.state_dict(keep_vars=True))
    template = GraphTemplate(ref=ref, spec=spec, model=model, compiled=model._graph, state=state,
                             parameters=frozenset(n for n, _ in model.named_parameters()), users=users,
                             index_bounds=dict(getattr(model, "index_bounds", {})), first_output=first_output)
    caches.graph_templates.put(key, template)
    return template


def _fresh(template: GraphTemplate, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """A GraphModel of its own (zero-filled on a device), from the validated graph: ~10x cheaper than
    a deep copy of the template's module tree."""
    return GraphModel(template.compiled, device=device, dtype=dtype)


def _batch_flow(caches: EngineCaches, template: GraphTemplate, dtype: torch.dtype,
                inputs: Batch) -> tuple[list, tuple[int, int] | None]:
    """((node, op, module path) of the nodes that combine the examples of a batch, where the batch sits in
    the first output): two meta runs of a private copy, once per input signature."""
    key = (template.key, dtype, inputs.signature)
    hit = caches.batch_flows.get(key)
    if hit is None:
        hit = graph_batch_flow(template, dtype, inputs)
        caches.batch_flows.put(key, hit)
    return hit


def graph_batch_flow(template: GraphTemplate, dtype: torch.dtype, inputs: Batch) -> tuple[list, tuple[int, int] | None]:
    """batch_flow on a private meta copy of the template's model (a run writes its program cache)."""
    mixing, out = batch_flow(_fresh(template, "meta", dtype), [list(x.shape) for x in inputs.tensors],
                             batched=list(inputs.batched))
    return [tuple(x) for x in mixing], out


def _graph_input(raw, where: str, spec, template: GraphTemplate, dtype: torch.dtype, limits,
                 shape_only: bool) -> torch.Tensor:
    """One user input: floating in the model's dtype; integer (token ids, edge indices) and bool (masks)
    kept as the graph captured them."""
    value = as_tensor_value(raw, where)
    if sparse.is_sparse_value(value) or spec.layout is not None:
        if not sparse.is_sparse_value(value):
            raise SpecError("bad_tensor", f"{where}: the graph takes a {spec.layout} tensor here (input "
                            f"{spec.name!r}); send {{dtype, shape, layout: {spec.layout!r}, ...}} with its parts "
                            "(docs/api.md, Tensors)", where=where)
        x = sparse.decode(value, spec.layout, where, limits.max_elements)
        return x.to(dtype) if x.is_floating_point() else x
    x = tensors.decode(value, where=where, max_elements=limits.max_elements, shape_only=shape_only,
                       complex_ok=bool(spec.dtype and spec.dtype.startswith("complex")))
    want = spec.dtype
    want_dtype = tensors.TORCH_DTYPES.get(want or "", torch.float32)
    if want_dtype.is_complex:  # a spectrum, a complex signal: real values are complex ones without an imaginary part
        x = x.to(want_dtype)
        if not x.is_meta and not tensors.all_finite(x):
            raise SpecError("bad_tensor", f"{where} holds NaN or infinite values", where=where)
    elif not want_dtype.is_floating_point:
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
    values = input_values(request.inputs, names, what="the graph")
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


def _graph_output(caches: EngineCaches, template: GraphTemplate, dtype: torch.dtype, inputs: Batch, limits,
                  math_attention: bool = False) -> torch.Tensor:
    """The graph's first output for `inputs`, as a meta tensor; validate_graph_shapes ran once per input
    signature (on a private copy of the shared model: a run writes its program cache)."""
    key = (template.key, dtype, inputs.signature, math_attention)
    hit = caches.graph_shapes.get(key)
    if hit is None:
        out = validate_graph_shapes(_fresh(template, "meta", dtype), *[sparse.on_meta(x) for x in inputs.tensors],
                                 limits=limits, math_attention=math_attention)
        hit = (out.shape, out.dtype, out.requires_grad)
        caches.graph_shapes.put(key, hit)
    shape, out_dtype, requires_grad = hit
    _check_differentiable(template, out_dtype, requires_grad)
    return torch.empty(shape, dtype=out_dtype, device="meta")


def _output_shapes(template: GraphTemplate, dtype: torch.dtype, inputs: Batch) -> list | None:
    """Every output's (shape, dtype), from a meta run of a private copy; None when the run fails."""
    try:
        with torch.no_grad():
            values = _fresh(template, "meta", dtype).run(*[sparse.on_meta(x) for x in inputs.tensors])
    except Exception:  # noqa: BLE001  (validate_graph_shapes runs next and names the node that failed)
        return None
    return [(list(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ([1, 1], torch.int64) for v in values]


def _check_differentiable(template: GraphTemplate, out_dtype: torch.dtype, requires_grad: bool) -> None:
    """The loss differentiates the first output: one of integers (argmax, a comparison) or one cut off from
    every parameter (aten.detach last, a no_grad region) has no gradient; else the worker's backward fails."""
    if out_dtype.is_floating_point and requires_grad:
        return  # (the node that made it is looked for only to name it in an error)
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
                   max_elements: int) -> None:
    """Every parameter and buffer checked, on meta: those sent by reference by their dtype and shape (a worker
    checks their bytes when it puts them in place), the others decoded."""
    layouts = _layouts(template)
    rest = check_by_reference(_checked_names(request, template), template.state, max_elements, "the graph", layouts)
    decode_weights(rest, template.state, template.parameters, dtype, max_elements, "the graph", layouts)


def _layouts(template: GraphTemplate) -> dict[str, str]:
    """The parameters and buffers the graph declares sparse, by state_dict name."""
    return {i.target: i.layout for i in template.spec.inputs
            if i.kind in ("parameter", "buffer") and i.layout is not None}


def _checked_names(request: GradientRequest, template: GraphTemplate) -> dict:
    """The request's wire weights, once each name is the graph's and every parameter and buffer is given: a
    graph has no initialiser to fill a gap."""
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
    return given


class GraphSpecModel:
    """The model side of prepare() for model.graph / model.graph_ref (prepare.py runs the checks in order)."""

    def __init__(self, request: GradientRequest, config: EngineConfig, caches: EngineCaches, dtype: torch.dtype,
                 graphs: GraphResolver | None) -> None:
        self.request, self.config, self.caches, self.dtype = request, config, caches, dtype
        ref, spec, self.graph_data = _graph_spec(caches, request, dtype, graphs)
        self.template = template = _graph_template(caches, ref, spec, dtype, config)
        self.meta = template.model
        self.top_layers = 1
        self.parameter_names = template.parameter_names
        self.parameter_count = template.parameter_count
        self.flow: tuple | None = None  # the batch flow, found on meta the first time a check needs it
        self.prepared: str | None = None  # after model() on a device: "resident" or "built", and the bytes copied
        self.copied_bytes = 0

    def inputs(self, shape_only: bool) -> Batch:
        return _graph_inputs(self.request, self.template, self.dtype, self.config.limits, shape_only)

    def output(self, inputs: Batch) -> torch.Tensor:
        k = self._loss_output(inputs)
        if k != self.template.first_output:
            self.template = _graph_template(self.caches, self.template.ref, self.template.spec, self.dtype,
                                            self.config, k)
            self.meta = self.template.model
        return _graph_output(self.caches, self.template, self.dtype, inputs, self.config.limits,
                             math_attention=self.request.options.hvp is not None)

    def _loss_output(self, inputs: Batch) -> int:
        """The output `loss: "output"` (or {"output": k}) differentiates: 0 unless the graph returns several."""
        own = next((t for t in loss_terms(self.request) if t.type == OWN_LOSS), None)
        spec = self.template.spec
        if own is None or (len(spec.outputs) < 2 and own.output is None):
            return 0
        key = ("loss output", self.template.ref, self.dtype, inputs.signature, own.output)
        hit = self.caches.graph_shapes.get(key)
        if hit is None:
            shapes = _output_shapes(self.template, self.dtype, inputs)
            if shapes is None:
                return 0  # the graph cannot run on these inputs: the shape check names the node
            hit = outputs.pick_loss(outputs.tree_of(spec), shapes, own.output)
            self.caches.graph_shapes.put(key, hit)
        return hit

    def batch_flow(self, inputs: Batch) -> tuple:
        if self.flow is None:
            self.flow = _batch_flow(self.caches, self.template, self.dtype, inputs)
        return self.flow

    def validate_splits(self, opts: Options, inputs: Batch) -> None:
        """Options that cannot mean for this graph what they mean for a layer spec, refused before the queue."""
        validate_sparse_parameters(self.template, opts, inputs.rows)
        if opts.checkpoint_segments is not None:
            raise SpecError("bad_option", "options.checkpoint_segments splits a layer spec's top-level layers; a "
                            "graph model has none, so it cannot apply. Remove it (or checkpoint inside the module "
                            "before export)")
        if opts.input_grad:
            floating = inputs.floating()
            if not floating:
                x = inputs.first
                raise SpecError("bad_option", f"options.input_grad: the inputs are integer {str(x.dtype)[6:]} "
                                "(token ids), which have no gradient; leave input_grad out")
            if len(floating) > 1:
                raise SpecError("bad_option", f"options.input_grad: the model takes {len(floating)} floating inputs "
                                f"({', '.join(inputs.names[i] for i in floating)}); input_grad returns the gradient "
                                "of one input tensor. Leave it out, or export a model with one floating input")
        split = splits(opts, inputs.rows)
        if opts.outputs and (split or opts.shards == "auto"):
            option = split[0] if split else "options.shards"
            raise SpecError("bad_option", f"options.outputs returns forward's outputs for the batch run as one "
                            f"forward; {option} runs it in parts. Leave one of them out", option=option)
        if opts.micro_batch is not None and opts.micro_batch < inputs.rows:
            validate_graph_split(self.template, self.batch_flow(inputs)[0], "options.micro_batch")
        if per_example_option(opts):
            validate_graph_split(self.template, self.batch_flow(inputs)[0], per_example_option(opts))
        if "options.shards" in splits(opts, inputs.rows):  # what mixes is the clearer reason
            validate_graph_split(self.template, self.batch_flow(inputs)[0], "options.shards", across_jobs=True)

    def output_batch(self, opts: Options, inputs: Batch, split: bool = False) -> tuple[int, int] | None:
        maybe_split = split or splits(opts, inputs.rows) or opts.shards == "auto"
        return self.batch_flow(inputs)[1] if maybe_split and any(inputs.batched) else None

    def validate_batch_statistics(self, opts: Options, inputs: Batch) -> None:
        """A graph's batch statistics are nodes, found by its batch flow (validate_splits)."""

    def model(self, device: str | torch.device, shape_only: bool, scope: str | None = None) -> tuple[nn.Module, tuple | None]:
        """(the model, (its key, its Resident) to hand it back to the resident pool under). On meta every weight
        is decoded and checked, and the model is the template's (read, never run or changed, on that path) or,
        for POST /estimate (`shape_only`, which runs it), a private copy; on a device a GraphModel held from an
        earlier request of this graph and `scope` when there is one (resident.py: only the weights not in place
        are decoded, checked and copied in), else a GraphModel of its own with the weights."""
        template, dtype, max_elements = self.template, self.dtype, self.config.limits.max_elements
        if str(device) == "meta":
            _graph_weights(self.request, template, dtype, max_elements)
            return (template.model if not shape_only else _fresh(template, device, dtype)), None
        key = (template.ref, dtype, str(device), scope)
        keep = resident.keeps(device, self.config)

        def make() -> resident.Resident:
            return resident.Resident(_fresh(template, device, dtype), template.parameters, tag=template.first_output)

        held, hit = resident.checkout(self.caches, key, make) if keep else (make(), False)
        adopted = 0
        if held.tag != template.first_output:  # the same graph with another loss output: another program
            old, held, hit = held, make(), False
            adopted = held.adopt(old)  # its weights in place, copied on the device
        given = _checked_names(self.request, template)
        identities = {n: resident.identity(w) for n, w in given.items()}
        in_place = held.in_place(identities)
        stale = [n for n in given if n not in in_place]
        resident.refuse_unresolved(given, stale)

        def decode(names: list[str]) -> dict[str, torch.Tensor]:
            return decode_weights({n: given[n] for n in names}, template.state, template.parameters, dtype,
                                  max_elements, "the graph", _layouts(template))

        copied = resident.load_grouped(held, stale, decode, identities, resident.staging_for(self.caches, device),
                                       template.sizes)
        self.prepared, self.copied_bytes = ("resident" if hit else "built"), copied + adopted
        return held.model, ((key, held) if keep else None)

    def model_sharing(self, device: str | torch.device, shared: dict[str, nn.Parameter]) -> nn.Module:
        """A training session's model of its own on `device` over the frozen weights `shared` (a worker's
        FrozenStore's: decoded and checked when first held), taken as they are; the other weights decoded, checked
        and copied in. A refs-only weight not in `shared` is refused as tensor_not_found."""
        template, dtype = self.template, self.dtype
        given = _checked_names(self.request, template)
        rest = {n: w for n, w in given.items() if n not in shared}
        resident.refuse_unresolved(rest, list(rest))
        held = resident.Resident(sharing(template.compiled, device=device, dtype=dtype, shared=shared),
                                 template.parameters, keep=False)
        held.load(decode_weights(rest, template.state, template.parameters, dtype, self.config.limits.max_elements,
                                 "the graph", _layouts(template)), {})
        return held.model


def validate_sparse_parameters(template: GraphTemplate, opts: Options, rows: int) -> None:
    """A sparse trainable parameter's gradient is the batch's, returned sparse as torch computes it; the options
    that combine or transform gradients (parts of the batch added up, per-example gradients, norms, clipping,
    second derivatives) take dense ones, so they are refused naming the parameter."""
    frozen = set(opts.freeze)
    sparse = [i.target for i in template.spec.inputs if i.kind == "parameter" and i.layout is not None
              and i.target not in frozen]
    if not sparse:
        return
    asked = [name for name, on in (
        ("options.micro_batch", opts.micro_batch is not None and opts.micro_batch < rows),
        ("options.shards", opts.shards != 1), ("options.per_sample", opts.per_sample != "off"),
        ("options.batch_gradient", not opts.batch_gradient), ("options.diagnostics", bool(opts.diagnostics)),
        ("options.clip", opts.clip is not None), ("options.hvp", opts.hvp is not None),
        ("options.curvature", opts.curvature is not None)) if on]
    if asked:
        raise SpecError("bad_option", f"{asked[0]}: parameter {sparse[0]!r} is sparse, and {asked[0]} works on dense "
                        "gradients; leave it out, freeze the parameter (options.freeze), or make it dense",
                        option=asked[0].removeprefix("options."), parameter=sparse[0])


def validate_graph_split(template: GraphTemplate, mixing: list, option: str, *, across_jobs: bool = False) -> None:
    """Refuses `option` (which splits the batch) when a node mixes the batch's examples (`mixing`, from the
    batch flow); `across_jobs` (options.shards) also when one draws dropout masks, which every shard would
    seed alike."""
    if mixing:
        node, op, module = mixing[0]
        where = f"module {module!r}" if module else "the root module"
        raise SpecError("bad_option", f"{option}: node {node!r} ({op}) in {where} combines the examples of a batch "
                        f"(batch statistics), so a part of the batch does not give its share of the batch's "
                        f"gradient; remove {option}, or put that module in eval mode before export",
                        node=node, op=op, module=module)
    drawing = next((s for s in template.compiled.steps if s.op.random), None)
    if drawing is not None:
        where = f"module {drawing.module!r}" if drawing.module else "the root module"
        raise SpecError("bad_option", f"{option}: node {drawing.name!r} ({drawing.op.name}) in {where} draws random "
                        f"numbers, and a part of the batch draws other numbers than the whole batch does (the seed "
                        f"replays one forward over the whole batch), so the parts' gradients would not add up to the "
                        f"batch's; remove {option}", node=drawing.name, op=drawing.op.name, module=drawing.module)
    if across_jobs:
        random = next((s for s in template.compiled.steps if draws_masks(s)), None)
        if random is not None:
            raise SpecError("bad_option", f"{option}: node {random.name!r} ({random.op.name}) in module "
                            f"{random.module!r} draws dropout masks from model.seed, which every shard would repeat; "
                            f"set shards=1 (micro_batch bounds memory), or export in eval mode",
                            node=random.name, module=random.module)
