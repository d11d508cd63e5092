"""Graph models: a GraphSpec checked before anything runs (validate_graph), built into an nn.Module whose
parameters carry the exporting module's state_dict names (build_graph), and interpreted node by node.

The checks, in order: format version, node count, names, inputs (state_dict targets, dtypes, shapes),
then each node: an allow-listed op (ops.py), its arguments bound against the op's torch schema (arity,
keywords, kinds), every `{"node": x}` naming an input or an EARLIER node (so no cycle, no forward or
dangling reference), in-place writes only on intermediates or buffers. Shapes, dtypes and the bytes
of every intermediate are checked by running on the meta device (check_graph_shapes).

For the memory table, `GraphModel.node_modules[i]` is node i's (name, module path, module type) and,
while `track_modules` is True, `current_module` / `current_module_type` hold the running node's
module path and class name (a saved-tensors hook reads them to attribute saved bytes).
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from gradsvc.wire import GraphSpec

from . import tensors
from .errors import SpecError
from .footprint import workspace_elements
from .ops import ALLOWED_OPS_DOC, OPS, Op
from .spec import Limits

FORMAT_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9_]{1,200}$")
_DEVICE = re.compile(r"^(cpu|cuda|meta|mps)(:\d{1,3})?$")
_DTYPES = {**tensors.TORCH_DTYPES, "int8": torch.int8, "int16": torch.int16}  # dtype arguments
_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
                   "channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d}
_MAX_LIST = 100_000
_MAX_VALUES = 2_000_000  # argument values in one graph (a size list counts each item)
_SHOW = reprlib.Repr()  # short, depth-limited reprs of request values in messages
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxstring, _SHOW.maxother = 3, 6, 3, 60, 60
# Ops that write these arguments in place in training mode (running statistics): they must be buffers.
_STAT_WRITES = {"aten.batch_norm.default": ("running_mean", "running_var"),
                "aten.native_batch_norm.default": ("running_mean", "running_var"),
                "aten.instance_norm.default": ("running_mean", "running_var")}


class Ref:
    """`{"node": name}`: the value in slot `i` (inputs first, then nodes in order)."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"Ref({self.i})"


class FloatDType:
    """A floating dtype named in the graph; mapped to the run dtype when the program is compiled."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Device:
    """A device named in the graph: always the device the model runs on."""


DEVICE = _Device()


@dataclass(frozen=True)
class Step:
    slot: int
    name: str
    op: Op
    args: tuple
    kwargs: dict
    module: str
    module_type: str
    writes_buffer: bool  # an in-place op on a buffer: runs under no_grad, as eager buffer updates do


@dataclass(frozen=True)
class Compiled:
    """A validated graph: slots of inputs and steps, outputs as compiled values."""

    inputs: list  # (slot, GraphInput)
    steps: list[Step]
    outputs: list
    mutations: list  # (buffer target, slot)
    constants: dict[str, torch.Tensor]
    n_slots: int
    dtype: torch.dtype
    index_bounds: dict[str, int]  # user input name -> rows of the smallest embedding table it indexes

    def __deepcopy__(self, memo: dict) -> "Compiled":
        return self  # immutable


def _bad(message: str, code: str = "bad_option", **detail: Any) -> SpecError:
    return SpecError(code, f"model.graph: {message}", **detail)


def _where(node: Any) -> str:
    module = f" in module {node.module!r} ({node.module_type})" if node.module else ""
    return f"node {node.name!r} ({node.op}){module}"


# ---- validation -----------------------------------------------------------------------------------

def validate_graph(spec: GraphSpec, *, limits: Limits) -> None:
    """Raises SpecError for anything wrong in the graph's structure; runs nothing."""
    compile_graph(spec, limits=limits)


def compile_graph(spec: GraphSpec, *, limits: Limits) -> Compiled:
    if spec.version != FORMAT_VERSION:
        raise _bad(f"format version {spec.version} is not supported; this service reads version {FORMAT_VERSION}")
    if len(spec.nodes) > limits.max_graph_nodes:
        raise _bad(f"{len(spec.nodes)} nodes, above the limit of {limits.max_graph_nodes}; export a smaller model",
                   "too_large", nodes=len(spec.nodes), limit=limits.max_graph_nodes)
    if len(spec.inputs) > limits.max_graph_nodes:
        raise _bad(f"{len(spec.inputs)} inputs, above the limit of {limits.max_graph_nodes}; export a smaller model",
                   "too_large", inputs=len(spec.inputs), limit=limits.max_graph_nodes)
    if spec.dtype not in tensors.FLOAT_DTYPES:
        raise _bad(f"dtype {spec.dtype!r} is not a floating dtype; use one of {', '.join(tensors.FLOAT_DTYPES)}")
    if not spec.outputs:
        raise _bad("'outputs' is empty; a graph returns at least one tensor (the loss applies to the first)")
    slots: dict[str, int] = {}
    kinds: list[str] = []
    roots: list[int] = []  # the slot whose storage a value shares (views, in-place results)
    input_kind: dict[int, str] = {}
    inputs = []
    targets: dict[str, str] = {}
    constants: dict[str, torch.Tensor] = {}
    for i, inp in enumerate(spec.inputs):
        where = f"inputs[{i}] ({inp.name!r})"
        _check_name(inp.name, where, slots)
        if inp.kind in ("parameter", "buffer"):
            _check_target(inp.target, where, targets)
            targets[inp.target] = inp.kind
            if inp.dtype not in tensors.TORCH_DTYPES or inp.shape is None or len(inp.shape) > 8 or \
                    any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in inp.shape):
                raise _bad(f"{where}: a {inp.kind} needs 'dtype' (one of {', '.join(tensors.TORCH_DTYPES)}) and "
                           f"'shape' (at most 8 sizes >= 0), got dtype={inp.dtype!r} shape={inp.shape!r}",
                           input=inp.name)
            if inp.kind == "parameter" and not _DTYPES[inp.dtype].is_floating_point:
                raise _bad(f"{where}: parameter {inp.target!r} has dtype {inp.dtype}; parameters are floating-point",
                           input=inp.name)
        elif inp.kind == "constant":
            if inp.target not in spec.constants:
                raise _bad(f"{where}: constant {inp.target!r} is not in 'constants' (keys: "
                           f"{sorted(spec.constants)[:8]})", input=inp.name)
            constants[inp.target] = tensors.decode(spec.constants[inp.target], where=f"model.graph.constants"
                                                   f"[{inp.target!r}]", max_elements=limits.max_elements)
        slot = len(kinds)
        slots[inp.name] = slot
        kinds.append("tensor")
        roots.append(slot)
        input_kind[slot] = inp.kind
        inputs.append((slot, inp))
    if not any(inp.kind == "input" for inp in spec.inputs):
        raise _bad("no input of kind 'input'; a graph takes the batch as at least one input")
    functions = _functions(spec, limits)
    later = {n.name for n in spec.nodes}
    budget = [_MAX_VALUES]
    inputs_by_slot = dict(inputs)
    index_bounds: dict[str, int] = {}
    steps: list[Step] = []
    step_of: dict[int, Step] = {}
    for node in spec.nodes:
        op = OPS.get(node.op) or functions.get(node.op)
        if op is None:
            raise SpecError("unsupported_op", f"model.graph: {_where(node)}: op {node.op!r} is not allowed; the "
                            f"allowed ops are listed in {ALLOWED_OPS_DOC}", op=node.op, node=node.name,
                            module=node.module)
        if len(node.module) > 1000 or len(node.module_type) > 200:
            raise _bad(f"node {node.name[:200]!r}: 'module' is at most 1000 characters and 'module_type' 200",
                       node=node.name[:200])
        ctx = _Context(node, slots, kinds, later, budget)
        args, kwargs, bound = _bind(node, op, ctx)
        if op.params and op.params[0].type[0] != "tensor" and any(p.name == "device" for p in op.params):
            kwargs["device"] = DEVICE  # a factory: on the model's device (meta while checking), never the host's
        if "pin_memory" in bound:
            kwargs["pin_memory"] = None  # page-locked host memory is the worker's to decide, not a graph's
        if node.op == "aten.embedding.default" and bound.get("sparse"):
            _set_arg(op, args, kwargs, "sparse", False)  # dense gradients, the same values: they travel
        slot = len(kinds)
        writes_buffer = False
        if op.inplace:
            target = bound[op.params[0].name]
            if not isinstance(target, Ref):
                raise _bad(f"{_where(node)}: an in-place op needs a tensor to write, got {_SHOW.repr(target)}",
                           node=node.name, op=node.op)
            writes_buffer = _check_write(node, target, roots, input_kind, "is written in place")
        training = bound.get("use_input_stats" if node.op == "aten.instance_norm.default" else "training")
        for arg in _STAT_WRITES.get(node.op, ()) if training is not False else ():
            if isinstance(bound.get(arg), Ref):
                _check_write(node, bound[arg], roots, input_kind, f"is written as {arg}", buffers_only=True)
        _check_name(node.name, _where(node), slots)
        slots[node.name] = slot
        if op is OPS["operator.getitem"]:
            kinds.append("tensor")
            roots.append(roots[args[0].i])
            _check_index(node, step_of.get(args[0].i), args)
        else:
            kinds.append(op.returns)
            first = next((a for a in args if isinstance(a, Ref)), None)
            roots.append(roots[first.i] if op.aliases_input and first is not None else slot)
        steps.append(Step(slot, node.name, op, tuple(args), kwargs, _module(node.module), node.module_type,
                          writes_buffer))
        step_of[slot] = steps[-1]
        if node.op == "aten.embedding.default" and isinstance(bound.get("indices"), Ref) and \
                isinstance(bound.get("weight"), Ref):
            source = inputs_by_slot.get(roots[bound["indices"].i])
            table = inputs_by_slot.get(bound["weight"].i)
            if source is not None and source.kind == "input" and table is not None and table.shape:
                index_bounds[source.name] = min(index_bounds.get(source.name, table.shape[0]), table.shape[0])
    out_ctx = _Context(None, slots, kinds, set(), budget)
    outputs = [_value(o, ("tensor",), out_ctx, f"outputs[{i}]") for i, o in enumerate(spec.outputs)]
    if not isinstance(outputs[0], Ref) or kinds[outputs[0].i] != "tensor":
        raise _bad("outputs[0] must be {\"node\": name} of a tensor (the loss applies to it)")
    mutations = []
    for target, name in spec.buffer_mutations.items():
        if targets.get(target) != "buffer":
            raise _bad(f"buffer_mutations: {target!r} is not a buffer input of the graph", target=target)
        if name not in slots or kinds[slots[name]] != "tensor":
            raise _bad(f"buffer_mutations[{target!r}]: {name!r} is not a tensor node of the graph", target=target)
        mutations.append((target, slots[name]))
    return Compiled(inputs=inputs, steps=steps, outputs=outputs, mutations=mutations, constants=constants,
                    n_slots=len(kinds), dtype=tensors.TORCH_DTYPES[spec.dtype], index_bounds=index_bounds)


def _functions(spec: GraphSpec, limits: Limits) -> dict[str, Op]:
    """The graph's custom autograd Functions as ops "function.<key>" (functions.py)."""
    if not spec.functions:
        return {}
    from .functions import MAX_FUNCTIONS, compile_function

    if len(spec.functions) > MAX_FUNCTIONS:
        raise _bad(f"{len(spec.functions)} custom autograd Functions, above the limit of {MAX_FUNCTIONS}", "too_large",
                   functions=len(spec.functions), limit=MAX_FUNCTIONS)
    nodes = len(spec.nodes) + sum(len(f.forward.nodes) + len(f.backward.nodes) for f in spec.functions.values())
    if nodes > limits.max_graph_nodes:
        raise _bad(f"{nodes} nodes with the Functions' graphs, above the limit of {limits.max_graph_nodes}; export "
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
        raise _bad(f"{where}: name {name!r} must be 1-200 characters from [A-Za-z0-9_]", name=str(name)[:200])
    if name in slots:
        raise _bad(f"{where}: name {name!r} is used twice; every input and node needs its own name", name=name)


def _check_target(target: str | None, where: str, targets: dict[str, str]) -> None:
    parts = target.split(".") if isinstance(target, str) else []
    if not parts or len(target) > 1000 or not all(_NAME.match(p) for p in parts):
        raise _bad(f"{where}: target {target!r} must be a state_dict name (dot-separated parts of [A-Za-z0-9_])",
                   target=target)
    if target in targets:
        raise _bad(f"{where}: target {target!r} appears twice; each parameter and buffer is one input",
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
    raise SpecError("unsupported_op", f"model.graph: {_where(node)}: its argument {how}, but it is {what}; "
                    "in-place writes are allowed only on intermediates and on buffers (running statistics)",
                    op=node.op, node=node.name, module=node.module)


def _check_index(node: Any, source: Step | None, args: list) -> None:
    index = args[1]
    if not isinstance(index, int) or index < 0:
        raise _bad(f"{_where(node)}: the index must be a literal integer >= 0", node=node.name)
    count = source.op.n_outputs if source is not None else None
    if count is not None and index >= count:
        raise _bad(f"{_where(node)}: index {index} is out of range; {source.name!r} ({source.op.name}) has "
                   f"{count} outputs", node=node.name)


class _Context:
    def __init__(self, node: Any, slots: dict[str, int], kinds: list[str], later: set[str], budget: list[int]) -> None:
        self.node, self.slots, self.kinds, self.later = node, slots, kinds, later
        self.budget = budget  # argument values the whole graph may still hold (one shared counter)

    def spend(self, n: int) -> None:
        self.budget[0] -= n
        if self.budget[0] < 0:
            raise _bad(f"the graph's arguments hold more than {_MAX_VALUES} values; export a smaller model",
                       "too_large", limit=_MAX_VALUES)

    def where(self, arg: str) -> str:
        return f"{_where(self.node)}, argument {arg!r}" if self.node is not None else arg


def _bind(node: Any, op: Op, ctx: _Context) -> tuple[list, dict, dict]:
    """Args and kwargs checked against the op's schema: arity, names, each value's kind."""
    if not isinstance(node.args, list) or not isinstance(node.kwargs, dict):
        raise _bad(f"{_where(node)}: 'args' must be a list and 'kwargs' an object", node=node.name)
    positional = [p for p in op.params if not p.kwarg_only]
    if len(node.args) > len(positional):
        raise _bad(f"{_where(node)}: {len(node.args)} positional arguments, but {op.name} takes at most "
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
            raise _bad(f"{_where(node)}: unknown keyword argument {key!r}; {op.name} takes "
                       f"{', '.join(by_name) or 'no keywords'}", node=node.name, op=node.op)
        if key in bound:
            raise _bad(f"{_where(node)}: argument {key!r} is given twice (positionally and by keyword)",
                       node=node.name, op=node.op)
        value = _value(a, p.type, ctx, key)
        bound[key] = kwargs[key] = value
    missing = [p.name for p in op.params if p.name not in bound and not p.has_default]
    if missing:
        raise _bad(f"{_where(node)}: missing required argument {missing[0]!r} of {op.name}", node=node.name,
                   op=node.op)
    return args, kwargs, bound


_NUMBER_KINDS = {"int", "float", "bool", "number", "tensor"}


def _value(v: Any, t: tuple, ctx: _Context, arg: str) -> Any:
    """A wire argument as the value passed to the op (Ref / FloatDType / DEVICE for the run-time parts)."""
    kind = t[0]

    def bad(expected: str) -> SpecError:
        shown = _SHOW.repr(v)
        node = ctx.node.name if ctx.node is not None else None
        return _bad(f"{ctx.where(arg)}: got {shown}, expected {expected}", node=node, argument=arg)

    if kind == "optional":
        return None if v is None else _value(v, t[1], ctx, arg)
    if isinstance(v, dict):
        if len(v) != 1:
            raise bad('an object with one key ("node", "float", "dtype", "device", "layout" or "memory_format")')
        (key, inner), = v.items()
        if key == "node":
            slot = ctx.slots.get(inner) if isinstance(inner, str) else None
            if slot is None:
                why = "is a LATER node (a forward reference or a cycle)" if inner in ctx.later else \
                    "is neither an input nor a node"
                raise bad(f"a reference to an input or an earlier node; {inner!r} {why}")
            have = ctx.kinds[slot]
            ok = {"tensor": {"tensor", "scalar"}, "int": {"scalar"}, "float": {"scalar"}, "bool": {"scalar"},
                  "number": {"scalar"}, "tensors": {"tensors"}}.get(kind, set())
            if have not in ok:
                raise bad(f"a {kind}; {inner!r} holds a {have}")
            return Ref(slot)
        if key == "float" and inner in ("inf", "-inf", "nan") and kind in ("float", "number", "tensor"):
            return float(inner)
        if key == "dtype" and kind == "dtype" and inner in _DTYPES:
            d = _DTYPES[inner]
            return FloatDType(d) if d.is_floating_point else d
        if key == "device" and kind == "device" and isinstance(inner, str) and _DEVICE.match(inner):
            return DEVICE
        if key == "layout" and kind == "layout" and inner in _LAYOUTS:
            return _LAYOUTS[inner]
        if key == "memory_format" and kind == "memory_format" and inner in _MEMORY_FORMATS:
            return _MEMORY_FORMATS[inner]
        raise bad(f"a {kind}" + {"dtype": f" as {{\"dtype\": one of {sorted(_DTYPES)}}}",
                                 "device": ' as {"device": "cpu"}', "layout": ' as {"layout": "strided"}',
                                 "memory_format": f" as {{\"memory_format\": one of {sorted(_MEMORY_FORMATS)}}}"
                                 }.get(kind, ""))
    if kind == "list":
        if isinstance(v, int) and not isinstance(v, bool) and t[1][0] == "int":
            return v  # an int for int[N], as torch accepts
        if not isinstance(v, list) or len(v) > _MAX_LIST:
            raise bad(f"a list of {t[1][0]} (at most {_MAX_LIST} items)")
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
    raise bad(f"a {kind}" + (' (non-finite floats as {"float": "inf"})' if isinstance(v, float) else ""))


# ---- the module ------------------------------------------------------------------------------------

class GraphModel(nn.Module):
    """An exported graph as a module: parameters and buffers under their state_dict names, forward
    interprets the nodes in order and returns the first user output (`run` returns them all)."""

    def __init__(self, compiled: Compiled, *, device: str | torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self._graph = compiled
        self._dtype = dtype
        self._programs: dict[tuple, tuple] = {}
        self.track_modules = False
        # False: run as captured (its own casts to other float dtypes stay, as in eager). True: every float
        # in float64 when running in float64, for the numerical check (HF's RMSNorm casts to float32).
        self.upcast_all = False
        self.current_module = ""
        self.current_module_type = ""
        self.node_modules = [(s.name, s.module, s.module_type) for s in compiled.steps]
        self.module_types = {s.module: s.module_type for s in compiled.steps}  # module path -> class name
        self.input_specs = [inp for _, inp in compiled.inputs if inp.kind == "input"]
        # Integer inputs that index an embedding table: name -> exclusive bound, for checking token ids
        # before the run (an id past the table is an IndexError in the worker, not a shape error).
        self.index_bounds = dict(compiled.index_bounds)
        self._holders: list[tuple[int, str, nn.Module, str]] = []  # (slot, kind, owner module, attribute)
        self._users: list[int] = []
        self._consts: list[tuple[int, str]] = []
        self._probe: tuple[nn.Module, str] | None = None
        holder: dict[str, tuple[nn.Module, str]] = {}
        self.failed_node: int | None = None  # after a failed run: the node's index and its arguments
        self.failed_args: list = []
        for slot, inp in compiled.inputs:
            if inp.kind == "input":
                self._users.append(slot)
            elif inp.kind == "constant":
                self._consts.append((slot, inp.target))
            else:
                owner, attr = self._owner(inp.target)
                want = _DTYPES[inp.dtype]
                if want.is_floating_point and (dtype == torch.float64 or want == compiled.dtype):
                    want = dtype
                make = torch.empty if str(device) == "meta" else torch.zeros  # never uninitialised memory
                t = make(inp.shape, dtype=want, device=device)
                try:
                    if inp.kind == "parameter":
                        owner.register_parameter(attr, nn.Parameter(t))
                        self._probe = self._probe or (owner, attr)
                    else:
                        owner.register_buffer(attr, t)
                except (KeyError, TypeError) as exc:
                    raise _bad(f"{inp.kind} {inp.target!r} cannot be registered: {exc}", "bad_weights",
                               parameter=inp.target) from None
                self._holders.append((slot, inp.kind, owner, attr))
                holder[inp.target] = (owner, attr)
        self._mutations = [(*holder[target], slot) for target, slot in compiled.mutations]

    def _owner(self, target: str) -> tuple[nn.Module, str]:
        *path, attr = target.split(".")
        owner: nn.Module = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                if hasattr(owner, part):
                    raise _bad(f"{target!r}: {part!r} clashes with an attribute of the graph model; rename the "
                               "submodule", "bad_weights", parameter=target)
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        if attr in owner._modules:
            raise _bad(f"{target!r} is also a module prefix of other parameters", "bad_weights", parameter=target)
        return owner, attr

    @property
    def run_dtype(self) -> torch.dtype:
        if self._probe is not None:
            owner, attr = self._probe
            return getattr(owner, attr).dtype
        return self._dtype

    def _program(self, dtype: torch.dtype, device: torch.device) -> tuple:
        key = (dtype, device, self.upcast_all)
        prog = self._programs.get(key)
        if prog is None:
            captured = self._graph.dtype

            def fix(a: Any) -> Any:
                if isinstance(a, FloatDType):
                    d = a.dtype
                    if dtype == captured and not self.upcast_all:
                        return d  # the model as captured: its own casts (float32 RMSNorm, rotary) stay
                    return torch.float64 if dtype == torch.float64 else (dtype if d == captured else d)
                if a is DEVICE:
                    return device
                if isinstance(a, list):
                    return [fix(x) for x in a]
                return a

            steps = []
            frees = _last_uses(self._graph)
            for i, s in enumerate(self._graph.steps):
                args = tuple(fix(a) for a in s.args)
                kwargs = {k: fix(v) for k, v in s.kwargs.items()}
                refs = tuple(i for i, a in enumerate(args) if _has_ref(a))
                krefs = tuple(k for k, v in kwargs.items() if _has_ref(v))
                steps.append((s.slot, s.op.fn, args, kwargs, refs, krefs, s.writes_buffer, s.op.is_assert, frees[i]))
            consts = []
            for slot, target in self._consts:
                c = self._graph.constants[target]
                if c.is_floating_point() and (dtype == torch.float64 or c.dtype == captured):
                    c = c.to(dtype)
                consts.append((slot, c.to(device)))
            prog = (steps, consts)
            self._programs[key] = prog
        return prog

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.run(*inputs)[0]

    def run(self, *inputs: torch.Tensor, visit: Callable | None = None) -> list:
        """Every user output; `visit(step_index, value, args)` is called after each node (meta checks)."""
        if len(inputs) != len(self._users):
            raise TypeError(f"the graph takes {len(self._users)} input(s), got {len(inputs)}")
        steps, consts = self._program(self.run_dtype, inputs[0].device)
        env: list[Any] = [None] * self._graph.n_slots
        for slot, _, owner, attr in self._holders:
            env[slot] = getattr(owner, attr)  # not _parameters[attr]: torch.func.functional_call swaps attributes
        for slot, value in consts:
            env[slot] = value
        for slot, x in zip(self._users, inputs):
            env[slot] = x
        track = self.track_modules
        node_modules = self.node_modules
        i = -1
        args: Any = ()
        kwargs: Any = {}
        self.failed_node = None
        try:
            for i, (slot, fn, args, kwargs, refs, krefs, writes_buffer, is_assert, free) in enumerate(steps):
                if is_assert:
                    continue
                if refs:
                    args = list(args)
                    for j in refs:
                        args[j] = _fill(args[j], env)
                if krefs:
                    kwargs = dict(kwargs)
                    for k in krefs:
                        kwargs[k] = _fill(kwargs[k], env)
                if track:
                    _, self.current_module, self.current_module_type = node_modules[i]
                if writes_buffer:
                    with torch.no_grad():
                        out = fn(*args, **kwargs)
                else:
                    out = fn(*args, **kwargs)
                env[slot] = out
                if visit is not None:
                    visit(i, out, args, kwargs)
                for j in free:  # as eager Python drops a value after its last use (peak memory)
                    env[j] = None
        except Exception:
            self.failed_node = i
            self.failed_args = [*args, *kwargs.values()] if i >= 0 else []
            raise
        finally:
            if track:
                self.current_module = self.current_module_type = ""
        for owner, attr, slot in self._mutations:
            buf = getattr(owner, attr)
            if env[slot] is not buf:
                with torch.no_grad():
                    buf.copy_(env[slot])
        return [_fill(o, env) for o in self._graph.outputs]


def _last_uses(graph: Compiled) -> list[tuple[int, ...]]:
    """For each step, the node slots read for the last time there (never outputs or buffer updates)."""
    last: dict[int, int] = {}
    first_node = graph.steps[0].slot if graph.steps else graph.n_slots
    for i, s in enumerate(graph.steps):
        for r in _refs([*s.args, *s.kwargs.values()]):
            if r.i >= first_node:
                last[r.i] = i
    keep = {r.i for r in _refs(graph.outputs)} | {slot for _, slot in graph.mutations}
    frees: list[list[int]] = [[] for _ in graph.steps]
    for i, s in enumerate(graph.steps):
        if s.slot not in keep:
            frees[last.get(s.slot, i)].append(s.slot)  # an unused value goes at once
    return [tuple(f) for f in frees]


def _refs(values: list) -> list[Ref]:
    out = []
    for a in values:
        if isinstance(a, Ref):
            out.append(a)
        elif isinstance(a, list):
            out.extend(_refs(a))
    return out


def _has_ref(a: Any) -> bool:
    return isinstance(a, Ref) or (isinstance(a, list) and any(_has_ref(x) for x in a))


def _fill(a: Any, env: list) -> Any:
    if type(a) is Ref:
        return env[a.i]
    if type(a) is list:
        return [_fill(x, env) for x in a]
    return a


def build_graph(spec: GraphSpec, *, limits: Limits, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> GraphModel:
    """The checked graph as a GraphModel on `device` (meta for validation; elsewhere zero-filled until the
    caller loads the weights: `to_empty` + `load_state_dict`, or load_weights below)."""
    compiled = compile_graph(spec, limits=limits)
    n = sum(math.prod(inp.shape) for _, inp in compiled.inputs if inp.kind == "parameter")
    if n > limits.max_parameters:
        raise _bad(f"the model has {n} parameters, above the limit of {limits.max_parameters}; use a smaller model",
                   "too_large", parameter_count=n, limit=limits.max_parameters)
    return GraphModel(compiled, device=device, dtype=dtype)


def load_weights(model: GraphModel, weights: dict[str, torch.Tensor], *, device: str | torch.device) -> GraphModel:
    """Every parameter and buffer from `weights` (all required: a graph has no initialiser), checked by
    name and shape, onto `device`."""
    state = model.state_dict(keep_vars=True)
    for name in weights:
        if name not in state:
            raise SpecError("bad_weights", f"weights: {name!r} is not a parameter or buffer of the graph; it has "
                            f"{sorted(state)[:12]}", parameter=name)
    for name, have in state.items():
        if name not in weights:
            kind = "parameter" if isinstance(have, nn.Parameter) else "buffer"
            raise SpecError("bad_weights", f"weights: {kind} {name!r} is missing; a graph model needs every "
                            "parameter and buffer it reads (export sends them all)", parameter=name)
        t = weights[name]
        if list(t.shape) != list(have.shape):
            raise SpecError("bad_weights", f"weights: {name!r} has shape {list(t.shape)}, the graph needs "
                            f"{list(have.shape)}", parameter=name, shape=list(t.shape), expected=list(have.shape))
        if isinstance(have, nn.Parameter) and not tensors.all_finite(t):
            raise SpecError("bad_weights", f"weights: {name!r} holds NaN or infinite values", parameter=name)
    model = model.to_empty(device=device)
    model.load_state_dict(weights)
    return model


# ---- meta-device checks ------------------------------------------------------------------------------

def _shapes(args: Any) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(list(a.shape))
        elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            out.append([list(x.shape) if isinstance(x, torch.Tensor) else x for x in a])
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def attention_elements(step: Step, args: list, kwargs: dict) -> int:
    """The attention matrix scaled_dot_product_attention's math kernel builds: batch x heads x L x S elements
    (query (..., L, E), key (..., S, E)); 0 for any other op. Node outputs do not show it: a [1, 1, 9000, 1]
    query outputs 9,000 elements and builds 81M."""
    if step.op.name != "aten.scaled_dot_product_attention.default" or len(args) < 2:
        return 0
    q, k = args[0], args[1]
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2 or k.dim() < 2:
        return 0
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    return math.prod(lead) * q.shape[-2] * k.shape[-2]


def check_graph_shapes(model: GraphModel, *x_meta: torch.Tensor, limits: Limits | None = None,
                       math_attention: bool = False) -> torch.Tensor:
    """Runs the graph on the meta device: any node that cannot take its inputs is a shape_mismatch naming
    the node, op, module path and input shapes; intermediates beyond the limits are too_large. With
    `math_attention` (options.hvp: attention runs its math kernel, which has a double backward), the
    attention matrix each scaled_dot_product_attention builds counts as an intermediate too. The first
    output is returned, its requires_grad as autograd set it."""
    limits = limits or Limits()
    steps = model._graph.steps
    total = [0]

    def visit(i: int, out: Any, args: list, kwargs: dict) -> None:
        step = steps[i]
        inner = attention_elements(step, args, kwargs) if math_attention else 0
        if inner > limits.max_elements:
            raise SpecError("too_large", f"model.graph: {_where_step(step)} builds an attention matrix of {inner} "
                            f"elements (batch x heads x query length x key length) for options.hvp, above the limit "
                            f"of {limits.max_elements}; send shorter sequences or a smaller batch, or leave "
                            "options.hvp out (the fused kernels do not build it)", node=step.name, elements=inner,
                            limit=limits.max_elements)
        total[0] += inner * (args[0].element_size() if inner else 0)
        _check_workspace(step, args, out, total[0], limits)
        if step.op.aliases_input and _shares_storage(out, args):
            return  # a view or an in-place result: no new memory (contiguous/reshape/to may copy instead)
        for t in _tensors(out):
            n = t.numel()
            if n > limits.max_elements:
                raise SpecError("too_large", f"model.graph: {_where_step(step)} makes a tensor of shape "
                                f"{list(t.shape)} ({n} elements), above the limit of {limits.max_elements}; "
                                "send a smaller batch or model", node=step.name, shape=list(t.shape),
                                limit=limits.max_elements)
            total[0] += n * t.element_size()
        if total[0] > limits.max_graph_intermediate_bytes:
            raise SpecError("too_large", f"model.graph: the intermediates up to {_where_step(step)} hold "
                            f"{total[0]} bytes, above the limit of {limits.max_graph_intermediate_bytes} a job may "
                            "use (GRADSVC_MAX_JOB_BYTES); send a smaller batch or model", node=step.name,
                            limit=limits.max_graph_intermediate_bytes)

    try:
        # With grad on (as the worker runs it, and no slower on meta): the output's requires_grad then says
        # whether a backward pass can start from it (prepare refuses a detached one before the queue).
        with torch.enable_grad(), torch.device("meta"):
            outs = model.run(*x_meta, visit=visit)
    except SpecError:
        raise
    except Exception as exc:
        i = model.failed_node
        if i is None or i < 0:
            raise SpecError("shape_mismatch", f"model.graph: the inputs do not fit the graph: {exc}") from None
        step = steps[i]
        env_args = _shapes(model.failed_args)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise SpecError("shape_mismatch", f"model.graph: {_where_step(step)} cannot take inputs of shapes "
                        f"{env_args}: {first}", node=step.name, op=step.op.name, module=step.module,
                        input_shapes=env_args) from None
    return outs[0]


def _check_workspace(step: Step, args: list, out: Any, held: int, limits: Limits) -> None:
    """The buffers a dense op copies its inputs into (footprint.workspace_elements), against the element
    limit and, with the intermediates held so far, the job's memory."""
    copies, columns = workspace_elements(step.op.name, args, out)
    extra = copies + columns
    if not extra:
        return
    size = extra * next((a.element_size() for a in args if isinstance(a, torch.Tensor)), 4)
    if copies > limits.max_elements or held + size > limits.max_graph_intermediate_bytes:
        raise SpecError("too_large", f"model.graph: {_where_step(step)} copies its inputs into buffers of {extra} "
                        f"elements ({size} bytes: an expanded or broadcast operand made dense, or a convolution's "
                        f"columns), above the limit of {limits.max_elements} elements per tensor or, with the "
                        f"{held} bytes held before it, of {limits.max_graph_intermediate_bytes} bytes a job may use "
                        "(GRADSVC_MAX_JOB_BYTES); materialize smaller operands or send a smaller batch",
                        node=step.name, elements=extra, limit=limits.max_elements,
                        limit_bytes=limits.max_graph_intermediate_bytes)


def _shares_storage(out: Any, args: Any) -> bool:
    """Whether `out` is (a view of) the op's first tensor argument: on meta too, storages are objects."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    outs = _tensors(out)
    if first is None or not outs:
        return False
    key = first.untyped_storage()._cdata
    return all(t.untyped_storage()._cdata == key for t in outs)


def _where_step(step: Step) -> str:
    module = f" in module {step.module!r} ({step.module_type})" if step.module else ""
    return f"node {step.name!r} ({step.op.name}){module}"


# ---- batch mixing ---------------------------------------------------------------------------------------

_TRAINING_ARG = {"aten.batch_norm.default": "training", "aten.native_batch_norm.default": "training"}
_NORMALIZED = {"aten.layer_norm.default", "aten.native_layer_norm.default", "aten.rms_norm.default"}


def batch_mixing_nodes(model: GraphModel, input_shape: list[int] | tuple[int, ...]) -> list[tuple[str, str, str]]:
    """batch_flow's mixing nodes: the first input of `input_shape`, any other at its exported shape, all
    batched along dim 0."""
    b = int(input_shape[0])
    shapes = [list(input_shape)] + [[b, *(spec.shape or [0])[1:]] for spec in model.input_specs[1:]]
    return batch_flow(model, shapes)[0]


def batch_flow(model: GraphModel, input_shapes: list[list[int]], *, batched: list[bool] | None = None
               ) -> tuple[list[tuple[str, str, str]], tuple[int, int] | None]:
    """(node, op, module path) of every node that mixes the examples of a batch, so that micro-batches,
    per-sample gradients and shards would not add up to the whole batch's gradient; and where the batch
    sits in the first output ((dim, rows per example), None where it is gone or mixed).

    `input_shapes` are the user inputs' shapes; `batched` says which carry the batch along dim 0 (all
    by default); the others keep their shape. The graph runs on meta at the batch size of the batched
    inputs and at one more; a dimension whose size
    changes between the two carries the batch. Each tensor's batch is tracked as (dim, inner): dim q of
    size outer * batch * inner, whose example index is (position // inner) % batch. A node mixes when it
    reduces or reorders along that dim (sum, softmax, sort, gather, ...), normalises over it (batch norm
    in training mode, layer norm over it), loses it (a full reduction, a matmul contracting it), changes
    its size in a way no example owns (a slice or concatenation of the batch), or reshapes across it. A
    graph whose second run fails (a static export: its batch size is baked into the graph) is reported
    at the node that failed."""
    batched = list(batched) if batched is not None else [True] * len(input_shapes)
    b1 = next((int(s[0]) for s, b in zip(input_shapes, batched) if b), 1)
    runs = []
    for batch in (b1, b1 + 1):
        shapes_in = [[batch, *shape[1:]] if b else list(shape) for shape, b in zip(input_shapes, batched)]
        xs = [torch.empty(shape, dtype=_DTYPES.get(spec.dtype or "", model.run_dtype), device="meta")
              for shape, spec in zip(shapes_in, model.input_specs)]
        shapes: dict[int, Any] = {slot: tuple(x.shape) for slot, x in zip(model._users, xs)}
        for slot, kind, owner, attr in model._holders:
            shapes[slot] = tuple((owner._parameters if kind == "parameter" else owner._buffers)[attr].shape)
        for slot, target in model._consts:
            shapes[slot] = tuple(model._graph.constants[target].shape)
        steps = model._graph.steps
        try:
            with torch.no_grad(), torch.device("meta"):
                model.run(*xs, visit=lambda i, out, a, k: shapes.__setitem__(steps[i].slot, _shape_of(out)))
        except Exception:
            failed = model.failed_node if model.failed_node is not None and model.failed_node >= 0 else 0
            step = steps[failed]
            return [(step.name, step.op.name, step.module)], None
        runs.append(shapes)
    flow = _BatchFlow(runs[0], runs[1], b1, [slot for slot, b in zip(model._users, batched) if b])
    mixing = [(s.name, s.op.name, s.module) for s in model._graph.steps if not s.op.is_assert and flow.mixes(s)]
    first = model._graph.outputs[0]
    where = flow.info.get(first.i) if isinstance(first, Ref) else None
    return mixing, (where if isinstance(where, tuple) and not mixing else None)


def draws_masks(step: Step) -> bool:
    """A node that draws dropout masks: dropout with p > 0 and train not False, or a recurrent op of
    several layers with dropout between them in training mode."""
    if step.op.recurrent:
        dropout, layers = _arg(step, "dropout"), _arg(step, "num_layers")
        return _arg(step, "train") is not False and dropout != 0 and layers != 1
    if "dropout" not in step.op.name:
        return False
    return _arg(step, "p") != 0 and _arg(step, "train") is not False


def _shape_of(out: Any) -> Any:
    """A tensor's shape (a tuple), several tensors' (a list), a size's value (an int), else None."""
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (list, tuple)):
        return [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in out]
    if isinstance(out, int) and not isinstance(out, bool):
        return out
    return None


def _arg(step: Step, name: str) -> Any:
    positional = [p for p in step.op.params if not p.kwarg_only]
    for idx, p in enumerate(positional):
        if p.name == name and idx < len(step.args):
            return step.args[idx]
    if name in step.kwargs:
        return step.kwargs[name]
    return next((p.default for p in step.op.params if p.name == name), None)


class _BatchFlow:
    """Where the batch sits in each value (slot -> (dim, inner), a list of them for several outputs,
    or None), node after node, from the shapes of two meta runs at batch sizes b and b + 1."""

    def __init__(self, shapes1: dict, shapes2: dict, b1: int, inputs: list[int]) -> None:
        self.s1, self.s2, self.b1 = shapes1, shapes2, b1
        self.info: dict[int, Any] = {slot: (0, 1) for slot in inputs}
        self.tainted: set[int] = set(inputs)
        # arange(batch) and its views and casts: indexing the batch dim with it picks each example itself
        # (`logits[torch.arange(batch), last_token]`, as Hugging Face sequence classifiers pool).
        self.iota: set[int] = set()

    def mixes(self, step: Step) -> bool:
        refs = [a for a in step.args if isinstance(a, Ref)] + \
            [x for a in step.args if isinstance(a, list) for x in a if isinstance(x, Ref)] + \
            [v for v in step.kwargs.values() if isinstance(v, Ref)]
        # Only values computed from the inputs' data can carry one example into another; an index
        # built from sizes (arange over the batch, position ids expanded to it) carries none.
        if step.op.returns != "scalar" and any(r.i in self.tainted for r in refs):
            self.tainted.add(step.slot)
        self._track_iota(step, refs)
        if step.op.name == "operator.getitem":
            src = self.info.get(step.args[0].i)
            self.info[step.slot] = src[step.args[1]] if isinstance(src, list) and step.args[1] < len(src) else None
            return False
        s1, s2 = self.s1.get(step.slot), self.s2.get(step.slot)
        if not isinstance(s1, (tuple, list)):
            return False  # a size or a bool, not data
        batched = [(r, self.info[r.i]) for r in refs if isinstance(self.info.get(r.i), tuple)]
        data = [(r, where) for r, where in batched if r.i in self.tainted]
        if isinstance(s1, list):
            outs = [self._output(step, a, b, batched, data) for a, b in zip(s1, s2)]
            self.info[step.slot] = [o for o, _ in outs]
            return any(m for _, m in outs) or self._along(step, data)
        out, mixes = self._output(step, s1, s2, batched, data)
        self.info[step.slot] = out
        return mixes or self._along(step, data)

    def _track_iota(self, step: Step, refs: list[Ref]) -> None:
        name = step.op.name
        if name in ("aten.arange.default", "aten.arange.start"):
            end, start = _arg(step, "end"), (_arg(step, "start") if name == "aten.arange.start" else 0)
            if isinstance(end, Ref) and start == 0 and (self.s1.get(end.i), self.s2.get(end.i)) == (self.b1, self.b1 + 1):
                self.iota.add(step.slot)
        elif refs and refs[0].i in self.iota and (step.op.aliases_input or name.startswith(("aten._to_copy",
                                                                                            "aten.to.", "aten.clone"))):
            self.iota.add(step.slot)

    def _output(self, step: Step, s1: Any, s2: Any, batched: list, data: list) -> tuple[Any, bool]:
        b1 = self.b1
        if s1 is None:
            return None, False
        if len(s1) != len(s2):
            return None, bool(data)
        dims = [d for d in range(len(s1)) if s1[d] != s2[d]]
        if not dims:
            return None, bool(data)  # the batch is gone: reduced, contracted or sliced away
        if len(dims) > 1:
            return None, bool(data)  # (batch, batch): every example against every other
        q = dims[0]
        if step.op.reshapes and batched:
            ref, (p, k) = batched[0]
            stride = k * math.prod(self.s1[ref.i][p + 1:])  # flat distance between examples' blocks
            after = math.prod(s1[q + 1:])
            if after == 0 or stride % after:
                return None, bool(data)
            inner = stride // after
            if s1[q] % (b1 * inner) or s1[q] // (b1 * inner) != s2[q] // ((b1 + 1) * inner):
                return None, bool(data)
            return (q, inner), False
        for ref, (p, k) in batched:
            shape_in = self.s1.get(ref.i)
            if isinstance(shape_in, tuple) and p < len(shape_in) and shape_in[p] == s1[q]:
                return (q, k), False
        if s1[q] == b1 and s2[q] == b1 + 1:
            return (q, 1), False
        return None, bool(data)  # the batch dim changed size: a slice or concatenation of the batch

    def _along(self, step: Step, batched: list) -> bool:
        if not batched:
            return False
        op = step.op
        if op.name in _TRAINING_ARG:
            return bool(_arg(step, _TRAINING_ARG[op.name]))
        ref, (p, _) = batched[0]
        rank = len(self.s1[ref.i]) if isinstance(self.s1.get(ref.i), tuple) else None
        if op.name in _NORMALIZED:
            shape = _arg(step, "normalized_shape")
            n = len(shape) if isinstance(shape, list) else 1
            return rank is not None and p >= rank - n
        if op.name == "aten.scaled_dot_product_attention.default":  # attends along dim -2 of query and key
            return any(p == len(self.s1[r.i]) - 2 for r, (p, _) in batched if isinstance(self.s1.get(r.i), tuple))
        if op.recurrent:
            return self._recurrent_mixes(step)
        if op.name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"):
            indices = _arg(step, "indices") or []
            return p < len(indices) and indices[p] is not None and \
                not (isinstance(indices[p], Ref) and indices[p].i in self.iota)
        if op.name.startswith("function."):
            return True  # a custom Function is opaque: what it does across the batch is not known here
        if not op.along_dim:
            return False
        dim = _arg(step, "dims") if any(q.name == "dims" for q in op.params) else _arg(step, "dim")
        if dim is None or dim == []:
            return True
        dims = dim if isinstance(dim, list) else [dim]
        if rank is None or any(not isinstance(d, int) for d in dims):
            return True
        return any(d % max(rank, 1) == p for d in dims)

    def _recurrent_mixes(self, step: Step) -> bool:
        """gru/lstm/rnn combine everything but the rows of their batch dim (time steps, features, layers):
        `input`'s dim 0 (batch_first) or 1, and dim 1 of each initial state (layers, batch, hidden). An
        unbatched 2-d input has no such dim. Data with the batch anywhere else, or with the examples in
        blocks of different sizes in `input` and the states (rows paired across examples), mixes."""
        source = _arg(step, "input")
        rank = len(self.s1[source.i]) if isinstance(source, Ref) and isinstance(self.s1.get(source.i), tuple) else 0
        rows = (0 if _arg(step, "batch_first") else 1) if rank == 3 else None
        states = _arg(step, "hx")
        states = states if isinstance(states, list) else [states]
        expected = [(source, rows)] + [(r, 1 if rows is not None else None) for r in states] + \
            [(r, None) for r in _arg(step, "params") or []]
        inner = set()
        for ref, want in expected:
            where = self.info.get(ref.i) if isinstance(ref, Ref) and ref.i in self.tainted else None
            if isinstance(where, tuple):
                if where[0] != want:
                    return True
                inner.add(where[1])
        return len(inner) > 1
