"""The graph compiler: a GraphSpec checked before anything runs (validate_graph) and compiled into slots
and steps (compile_graph); build_graph makes the compiled graph an nn.Module (interpreter.py's GraphModel)
whose parameters carry the exporting module's state_dict names.

The checks, in order: format version, node count, names, inputs (state_dict targets, dtypes, shapes),
then each node: an allow-listed op (ops.py), its arguments bound against the op's torch schema (arity,
keywords, kinds), every `{"node": x}` naming an input or an EARLIER node (so no cycle, no forward or
dangling reference), in-place writes only on intermediates or buffers. Shapes, dtypes and the bytes
of every intermediate are checked by running on the meta device (meta_check.py).
"""

from __future__ import annotations

import math
import re
import reprlib
from types import MappingProxyType
from typing import Any

import torch

from gradsvc.wire import GraphSpec

from .. import tensors
from ..errors import SpecError
from ..spec import Limits
from .functions import MAX_FUNCTIONS, compile_function
from .interpreter import GraphModel
from .ops import ALLOWED_OPS_DOC, OPS, REFUSED_CORE, Op
from .sized import sized_op
from .program import DEVICE, DTYPES, Compiled, FloatDType, Ref, Step, bad_graph, where_node

FORMAT_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9_]{1,200}$")
# A state_dict name's part: a module's or parameter's own name, which PyTorch allows any characters but "." (RegNet's
# blocks are "block1-0"); no spaces or other punctuation here.
_PART = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
_DEVICE = re.compile(r"^(cpu|cuda|meta|mps)(:\d{1,3})?$")
_LAYOUTS = MappingProxyType({"strided": torch.strided})
_MEMORY_FORMATS = MappingProxyType({"contiguous_format": torch.contiguous_format,
                                    "preserve_format": torch.preserve_format, "channels_last": torch.channels_last,
                                    "channels_last_3d": torch.channels_last_3d})
_MAX_LIST = 100_000
_MAX_VALUES = 2_000_000  # argument values in one graph (a size list counts each item)


def _show(value: Any) -> str:
    """A short, depth-limited repr of a request value, for messages."""
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 3, 6, 3, 60, 60
    return r.repr(value)


# Ops that write these arguments in place in training mode (running statistics): they must be buffers.
_STAT_WRITES = MappingProxyType({"aten.batch_norm.default": ("running_mean", "running_var"),
                                 "aten.native_batch_norm.default": ("running_mean", "running_var"),
                                 "aten._batch_norm_with_update.default": ("running_mean", "running_var"),
                                 "aten._native_batch_norm_legit.default": ("running_mean", "running_var"),
                                 "aten.instance_norm.default": ("running_mean", "running_var")})


def validate_graph(spec: GraphSpec, *, limits: Limits) -> None:
    """Raises SpecError for anything wrong in the graph's structure; runs nothing."""
    compile_graph(spec, limits=limits)


def compile_graph(spec: GraphSpec, *, limits: Limits) -> Compiled:
    """The graph checked, in the order the module docstring gives, and compiled into slots and steps."""
    _check_header(spec, limits)
    program = _Program(spec, limits)
    for i, inp in enumerate(spec.inputs):
        program.add_input(f"inputs[{i}] ({inp.name!r})", inp)
    if not any(inp.kind == "input" for inp in spec.inputs):
        raise bad_graph("no input of kind 'input'; a graph takes the batch as at least one input")
    functions = _functions(spec, limits)
    for node in spec.nodes:
        program.add_node(node, _op(node, functions))
    return program.compiled()


def _check_header(spec: GraphSpec, limits: Limits) -> None:
    """The format version, the node and input counts, the dtype, and that there is an output."""
    if spec.version != FORMAT_VERSION:
        raise bad_graph(f"format version {spec.version} is not supported; this service reads version {FORMAT_VERSION}")
    if len(spec.nodes) > limits.max_graph_nodes:
        raise bad_graph(f"{len(spec.nodes)} nodes, above the limit of {limits.max_graph_nodes}; export a smaller model",
                   "too_large", nodes=len(spec.nodes), limit=limits.max_graph_nodes)
    if len(spec.inputs) > limits.max_graph_nodes:
        raise bad_graph(f"{len(spec.inputs)} inputs, above the limit of {limits.max_graph_nodes}; export a smaller model",
                   "too_large", inputs=len(spec.inputs), limit=limits.max_graph_nodes)
    if spec.dtype not in tensors.FLOAT_DTYPES:
        raise bad_graph(f"dtype {spec.dtype!r} is not a floating dtype; use one of {', '.join(tensors.FLOAT_DTYPES)}")
    if not spec.outputs:
        raise bad_graph("'outputs' is empty; a graph returns at least one tensor (the loss applies to the first)")


def _op(node: Any, functions: dict[str, Op]) -> Op:
    """The node's op: allow-listed, or one of the graph's custom Functions."""
    op = OPS.get(node.op) or functions.get(node.op)
    if op is None:
        why = REFUSED_CORE.get(node.op.removeprefix("aten."))
        why = f" ({why})" if why else ""
        raise SpecError("unsupported_op", f"model.graph: {where_node(node)}: op {node.op!r} is not allowed{why}; "
                        f"the allowed ops are listed in {ALLOWED_OPS_DOC}", op=node.op, node=node.name,
                        module=node.module)
    if len(node.module) > 1000 or len(node.module_type) > 200:
        raise bad_graph(f"node {node.name[:200]!r}: 'module' is at most 1000 characters and 'module_type' 200",
                   node=node.name[:200])
    return op


class _Program:
    """The compiled graph as it grows, one input or node at a time: every name's slot, what each slot holds
    (kinds), the slot whose storage each shares (roots: views, in-place results), and the steps."""

    def __init__(self, spec: GraphSpec, limits: Limits) -> None:
        self.spec, self.limits = spec, limits
        self.slots: dict[str, int] = {}
        self.kinds: list[str] = []
        self.roots: list[int] = []
        self.input_kind: dict[int, str] = {}
        self.inputs: list = []
        self.inputs_by_slot: dict[int, Any] = {}
        self.targets: dict[str, str] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.index_bounds: dict[str, int] = {}
        self.steps: list[Step] = []
        self.step_of: dict[int, Step] = {}
        self.written_inputs: set[int] = set()  # inputs and constants a node writes in place: the run writes a copy
        self.later = {n.name for n in spec.nodes}
        self.budget = [_MAX_VALUES]

    def add_input(self, where: str, inp: Any) -> None:
        _check_name(inp.name, where, self.slots)
        if inp.kind in ("parameter", "buffer"):
            _check_state_input(where, inp, self.targets)
            self.targets[inp.target] = inp.kind
        elif inp.kind == "constant":
            if inp.target not in self.spec.constants:
                raise bad_graph(f"{where}: constant {inp.target!r} is not in 'constants' (keys: "
                           f"{sorted(self.spec.constants)[:8]})", input=inp.name)
            self.constants[inp.target] = tensors.decode(
                self.spec.constants[inp.target], where=f"model.graph.constants[{inp.target!r}]",
                max_elements=self.limits.max_elements, complex_ok=True)
        slot = len(self.kinds)
        self.slots[inp.name] = slot
        self.kinds.append("tensor")
        self.roots.append(slot)
        self.input_kind[slot] = inp.kind
        self.inputs.append((slot, inp))
        self.inputs_by_slot[slot] = inp

    def add_node(self, node: Any, op: Op) -> None:
        args, kwargs, bound = _bind(node, op, _Context(node, self.slots, self.kinds, self.later, self.budget))
        if op.params and op.params[0].type[0] != "tensor" and any(p.name == "device" for p in op.params):
            kwargs["device"] = DEVICE  # a factory: on the model's device (meta while checking), never the host's
        if "pin_memory" in bound:
            kwargs["pin_memory"] = None  # page-locked host memory is the worker's to decide, not a graph's
        if node.op == "aten.embedding.default" and bound.get("sparse"):
            _set_arg(op, args, kwargs, "sparse", False)  # dense gradients, the same values: they travel
        slot = len(self.kinds)
        writes_buffer = self._writes(node, op, bound)
        _check_name(node.name, where_node(node), self.slots)
        self.slots[node.name] = slot
        if op is OPS["operator.getitem"]:
            self.kinds.append("tensor")
            self.roots.append(self.roots[args[0].i])
            _check_index(node, self.step_of.get(args[0].i), args)
        else:
            self.kinds.append(op.returns)
            first = next((a for a in args if isinstance(a, Ref)), None)
            self.roots.append(self.roots[first.i] if op.aliases_input and first is not None else slot)
            if writes_buffer:  # an in-place op returns the buffer itself: `ema.mul_(d).add_(x)` writes it twice
                self.roots[slot], self.input_kind[slot] = slot, "buffer"
        if node.shape is not None:
            op = sized_op(node, op)
        self.steps.append(Step(slot, node.name, op, tuple(args), kwargs, _module(node.module), node.module_type,
                               writes_buffer))
        self.step_of[slot] = self.steps[-1]
        if node.op == "aten.embedding.default":
            self._bound_indices(bound)

    def _writes(self, node: Any, op: Op, bound: dict) -> bool:
        """Whether the node writes a buffer in place; its in-place and running-statistics writes checked."""
        writes_buffer = False
        if op.inplace:
            target = bound[op.params[0].name]
            if not isinstance(target, Ref):
                raise bad_graph(f"{where_node(node)}: an in-place op needs a tensor to write, got {_show(target)}",
                           node=node.name, op=node.op)
            root = self.roots[target.i]
            if self.input_kind.get(root) in ("input", "constant"):
                # `x.div_(255)`, `mask |= hit` on a constant made in forward: the run writes its own copy
                self.written_inputs.add(root)
            else:
                writes_buffer = _check_write(node, target, self.roots, self.input_kind, "is written in place")
        training = bound.get("use_input_stats" if node.op == "aten.instance_norm.default" else "training")
        for arg in _STAT_WRITES.get(node.op, ()) if training is not False else ():
            if isinstance(bound.get(arg), Ref):
                _check_write(node, bound[arg], self.roots, self.input_kind, f"is written as {arg}", buffers_only=True)
        return writes_buffer

    def _bound_indices(self, bound: dict) -> None:
        """An embedding's ids from a user input: that input's values must stay below the table's rows."""
        if not isinstance(bound.get("indices"), Ref) or not isinstance(bound.get("weight"), Ref):
            return
        source = self.inputs_by_slot.get(self.roots[bound["indices"].i])
        table = self.inputs_by_slot.get(bound["weight"].i)
        if source is not None and source.kind == "input" and table is not None and table.shape:
            self.index_bounds[source.name] = min(self.index_bounds.get(source.name, table.shape[0]), table.shape[0])

    def compiled(self) -> Compiled:
        """The outputs and buffer mutations checked, and the whole as a Compiled."""
        spec, slots, kinds = self.spec, self.slots, self.kinds
        out_ctx = _Context(None, slots, kinds, set(), self.budget)
        outputs = [_value(o, ("tensor",), out_ctx, f"outputs[{i}]") for i, o in enumerate(spec.outputs)]
        if not isinstance(outputs[0], Ref) or kinds[outputs[0].i] != "tensor":
            raise bad_graph("outputs[0] must be {\"node\": name} of a tensor (the loss applies to it)")
        mutations = []
        for target, name in spec.buffer_mutations.items():
            if self.targets.get(target) != "buffer":
                raise bad_graph(f"buffer_mutations: {target!r} is not a buffer input of the graph", target=target)
            if name not in slots or kinds[slots[name]] != "tensor":
                raise bad_graph(f"buffer_mutations[{target!r}]: {name!r} is not a tensor node of the graph",
                                target=target)
            mutations.append((target, slots[name]))
        return Compiled(inputs=self.inputs, steps=self.steps, outputs=outputs, mutations=mutations,
                        constants=self.constants, n_slots=len(kinds), dtype=tensors.TORCH_DTYPES[spec.dtype],
                        index_bounds=self.index_bounds, written_inputs=frozenset(self.written_inputs))


def _check_state_input(where: str, inp: Any, targets: dict[str, str]) -> None:
    """A parameter or buffer input: its state_dict target, dtype and shape."""
    _check_target(inp.target, where, targets)
    if inp.dtype not in tensors.TORCH_DTYPES or inp.shape is None or len(inp.shape) > 8 or \
            any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in inp.shape):
        raise bad_graph(f"{where}: a {inp.kind} needs 'dtype' (one of {', '.join(tensors.TORCH_DTYPES)}) and "
                   f"'shape' (at most 8 sizes >= 0), got dtype={inp.dtype!r} shape={inp.shape!r}",
                   input=inp.name)
    if inp.kind == "parameter" and not (DTYPES[inp.dtype].is_floating_point or DTYPES[inp.dtype].is_complex):
        raise bad_graph(f"{where}: parameter {inp.target!r} has dtype {inp.dtype}; parameters are floating-point "
                        "or complex",
                   input=inp.name)


def _functions(spec: GraphSpec, limits: Limits) -> dict[str, Op]:
    """The graph's custom autograd Functions as ops "function.<key>" (functions.py)."""
    if not spec.functions:
        return {}
    if len(spec.functions) > MAX_FUNCTIONS:
        raise bad_graph(f"{len(spec.functions)} custom autograd Functions, above the limit of {MAX_FUNCTIONS}", "too_large",
                   functions=len(spec.functions), limit=MAX_FUNCTIONS)
    nodes = len(spec.nodes) + sum(len(f.forward.nodes) + len(f.backward.nodes) for f in spec.functions.values())
    if nodes > limits.max_graph_nodes:
        raise bad_graph(f"{nodes} nodes with the Functions' graphs, above the limit of {limits.max_graph_nodes}; export "
                   "a smaller model", "too_large", nodes=nodes, limit=limits.max_graph_nodes)
    out = {}
    for key, f in spec.functions.items():
        _check_name(key, f"functions[{key[:200]!r}]", {})
        out[f"function.{key}"] = compile_function(key, f, compile_graph, limits).op(key)
    return out


def _set_arg(op: Op, args: list, kwargs: dict, name: str, value: Any) -> None:
    positional = [p.name for p in op.params if not p.kwarg_only]
    if name in positional and positional.index(name) < len(args):
        args[positional.index(name)] = value
    else:
        kwargs[name] = value


def _module(path: str) -> str:
    # torch.export labels nodes outside any module with a placeholder path; they belong to the root.
    return "" if path.startswith("_empty_nn_module_stack") else path


def _check_name(name: str, where: str, slots: dict[str, int]) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_graph(f"{where}: name {name!r} must be 1-200 characters from [A-Za-z0-9_]", name=str(name)[:200])
    if name in slots:
        raise bad_graph(f"{where}: name {name!r} is used twice; every input and node needs its own name", name=name)


def _check_target(target: str | None, where: str, targets: dict[str, str]) -> None:
    parts = target.split(".") if isinstance(target, str) else []
    if not parts or len(target) > 1000 or not all(_PART.match(p) for p in parts):
        raise bad_graph(f"{where}: target {target!r} must be a state_dict name (dot-separated parts of [A-Za-z0-9_-])",
                   target=target)
    if target in targets:
        raise bad_graph(f"{where}: target {target!r} appears twice; each parameter and buffer is one input",
                   target=target)


def _check_write(node: Any, ref: Ref, roots: list[int], input_kind: dict[int, str], how: str, *,
                 buffers_only: bool = False) -> bool:
    """Whether the write is on a buffer (True) or an intermediate (False); anything else is refused."""
    root = roots[ref.i]
    kind = input_kind.get(root)
    if kind == "buffer" and root == ref.i:
        return True
    if kind is None and not buffers_only:
        return False
    what = f"a view of {kind} input" if kind and root != ref.i else (f"{kind} input" if kind else "an intermediate")
    raise SpecError("unsupported_op", f"model.graph: {where_node(node)}: its argument {how}, but it is {what}; "
                    "in-place writes are allowed only on intermediates and on buffers (running statistics)",
                    op=node.op, node=node.name, module=node.module)


def _check_index(node: Any, source: Step | None, args: list) -> None:
    index = args[1]
    if not isinstance(index, int) or index < 0:
        raise bad_graph(f"{where_node(node)}: the index must be a literal integer >= 0", node=node.name)
    count = source.op.n_outputs if source is not None else None
    if count is not None and index >= count:
        raise bad_graph(f"{where_node(node)}: index {index} is out of range; {source.name!r} ({source.op.name}) has "
                   f"{count} outputs", node=node.name)


class _Context:
    def __init__(self, node: Any, slots: dict[str, int], kinds: list[str], later: set[str], budget: list[int]) -> None:
        self.node, self.slots, self.kinds, self.later = node, slots, kinds, later
        self.budget = budget  # argument values the whole graph may still hold (one shared counter)

    def spend(self, n: int) -> None:
        self.budget[0] -= n
        if self.budget[0] < 0:
            raise bad_graph(f"the graph's arguments hold more than {_MAX_VALUES} values; export a smaller model",
                       "too_large", limit=_MAX_VALUES)

    def where(self, arg: str) -> str:
        return f"{where_node(self.node)}, argument {arg!r}" if self.node is not None else arg


def _bind(node: Any, op: Op, ctx: _Context) -> tuple[list, dict, dict]:
    """Args and kwargs checked against the op's schema: arity, names, each value's kind."""
    if not isinstance(node.args, list) or not isinstance(node.kwargs, dict):
        raise bad_graph(f"{where_node(node)}: 'args' must be a list and 'kwargs' an object", node=node.name)
    positional = [p for p in op.params if not p.kwarg_only]
    if len(node.args) > len(positional):
        raise bad_graph(f"{where_node(node)}: {len(node.args)} positional arguments, but {op.name} takes at most "
                   f"{len(positional)} ({', '.join(p.name for p in positional)})", node=node.name, op=node.op)
    by_name = {p.name: p for p in op.params}
    bound: dict[str, Any] = {}
    args = []
    for p, a in zip(positional, node.args):
        value = _value(a, p.type, ctx, p.name)
        bound[p.name] = value
        args.append(value)
    kwargs = {}
    for key, a in node.kwargs.items():
        p = by_name.get(key)
        if p is None or op.name.startswith("operator."):
            raise bad_graph(f"{where_node(node)}: unknown keyword argument {key!r}; {op.name} takes "
                       f"{', '.join(by_name) or 'no keywords'}", node=node.name, op=node.op)
        if key in bound:
            raise bad_graph(f"{where_node(node)}: argument {key!r} is given twice (positionally and by keyword)",
                       node=node.name, op=node.op)
        value = _value(a, p.type, ctx, key)
        bound[key] = kwargs[key] = value
    missing = [p.name for p in op.params if p.name not in bound and not p.has_default]
    if missing:
        raise bad_graph(f"{where_node(node)}: missing required argument {missing[0]!r} of {op.name}", node=node.name,
                   op=node.op)
    return args, kwargs, bound



_NUMBER_KINDS = frozenset({"int", "float", "bool", "number", "tensor"})


def _value(v: Any, t: tuple, ctx: _Context, arg: str) -> Any:
    """A wire argument as the value passed to the op (Ref / FloatDType / DEVICE for the run-time parts)."""
    kind = t[0]
    if kind == "optional":
        return None if v is None else _value(v, t[1], ctx, arg)
    if isinstance(v, dict):
        return _tagged(v, kind, ctx, arg)
    if kind == "generator":
        raise _bad_value(v, ctx, arg, "null: random ops draw from the job's seed (model.seed), not from a generator "
                         "of the graph's; drop the generator argument")
    if kind == "list":
        if isinstance(v, int) and not isinstance(v, bool) and t[1][0] == "int":
            return v  # an int for int[N], as torch accepts
        if not isinstance(v, list) or len(v) > _MAX_LIST:
            raise _bad_value(v, ctx, arg, f"a list of {t[1][0]} (at most {_MAX_LIST} items)")
        ctx.spend(len(v))
        return [_value(x, t[1], ctx, arg) for x in v]
    if isinstance(v, bool):
        if kind in ("bool", "number"):
            return v
    elif isinstance(v, int):
        if kind in _NUMBER_KINDS - {"bool"}:
            return v
    elif isinstance(v, float):
        if kind in ("float", "number", "tensor") and math.isfinite(v):
            return v
    elif isinstance(v, str):
        if kind == "str" and len(v) <= 200:
            return v
    raise _bad_value(v, ctx, arg, f"a {kind}" + (' (non-finite floats as {"float": "inf"})'
                                                 if isinstance(v, float) else ""))


def _bad_value(v: Any, ctx: _Context, arg: str, expected: str) -> SpecError:
    node = ctx.node.name if ctx.node is not None else None
    return bad_graph(f"{ctx.where(arg)}: got {_show(v)}, expected {expected}", node=node, argument=arg)


# What a {"node": x} reference may hold for each argument kind.
_REF_HOLDS = MappingProxyType({"tensor": frozenset({"tensor", "scalar"}), "int": frozenset({"scalar"}),
                               "float": frozenset({"scalar"}), "bool": frozenset({"scalar"}),
                               "number": frozenset({"scalar"}), "tensors": frozenset({"tensors"})})


def _tagged(v: dict, kind: str, ctx: _Context, arg: str) -> Any:
    """An argument written as an object of one key: a node reference, a non-finite float, a dtype, a device,
    a layout or a memory format."""
    if len(v) != 1:
        raise _bad_value(v, ctx, arg, 'an object with one key ("node", "float", "dtype", "device", "layout" or '
                         '"memory_format")')
    (key, inner), = v.items()
    if key == "node":
        slot = ctx.slots.get(inner) if isinstance(inner, str) else None
        if slot is None:
            why = "is a LATER node (a forward reference or a cycle)" if inner in ctx.later else \
                "is neither an input nor a node"
            raise _bad_value(v, ctx, arg, f"a reference to an input or an earlier node; {inner!r} {why}")
        have = ctx.kinds[slot]
        if have not in _REF_HOLDS.get(kind, ()):
            raise _bad_value(v, ctx, arg, f"a {kind}; {inner!r} holds a {have}")
        return Ref(slot)
    if key == "float" and inner in ("inf", "-inf", "nan") and kind in ("float", "number", "tensor"):
        return float(inner)
    if key == "dtype" and kind == "dtype" and inner in DTYPES:
        d = DTYPES[inner]
        return FloatDType(d) if d.is_floating_point or d.is_complex else d
    if key == "device" and kind == "device" and isinstance(inner, str) and _DEVICE.match(inner):
        return DEVICE
    if key == "layout" and kind == "layout" and inner in _LAYOUTS:
        return _LAYOUTS[inner]
    if key == "memory_format" and kind == "memory_format" and inner in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[inner]
    raise _bad_value(v, ctx, arg, f"a {kind}" + {"dtype": f" as {{\"dtype\": one of {sorted(DTYPES)}}}",
                                                 "device": ' as {"device": "cpu"}', "layout": ' as {"layout": "strided"}',
                                                 "memory_format": f" as {{\"memory_format\": one of "
                                                                  f"{sorted(_MEMORY_FORMATS)}}}"}.get(kind, ""))


def build_graph(spec: GraphSpec, *, limits: Limits, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> GraphModel:
    """The checked graph as a GraphModel on `device` (meta for validation; elsewhere zero-filled until the
    caller loads the weights: `to_empty` + `load_state_dict`, or load_weights below)."""
    compiled = compile_graph(spec, limits=limits)
    n = sum(math.prod(inp.shape) for _, inp in compiled.inputs if inp.kind == "parameter")
    if n > limits.max_parameters:
        raise bad_graph(f"the model has {n} parameters, above the limit of {limits.max_parameters}; use a smaller model",
                   "too_large", parameter_count=n, limit=limits.max_parameters)
    return GraphModel(compiled, device=device, dtype=dtype)

