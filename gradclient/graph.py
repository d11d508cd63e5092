"""A torch.export ExportedProgram as the wire's GraphSpec: its FX nodes as wire nodes (nested module calls
inlined, each node named by the module it came from), its parameters and buffers by state_dict name; and
torch's reason for an export that failed, shortened for a message. Used for a module (export.py) and for
each custom autograd Function's forward and backward (functions.py).
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from gradsvc import wire

from .errors import UnsupportedModuleError
from .tensors import to_wire

_SCALAR_TYPES = (int, float, bool, str, type(None))


def reason(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return " / ".join(lines[:4])[:800] or type(exc).__name__


def convert_program(ep: "torch.export.ExportedProgram", module: nn.Module,
                    batched: list[bool]) -> tuple[wire.GraphSpec, dict[str, torch.Tensor]]:
    """The exported program as the wire's graph (its inputs, calls and outputs, in the parameters' dtype)
    and the weights it names, by state_dict name."""
    specs, kinds = _input_specs(ep)
    found = _Inputs(ep, module, batched)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        found.add(node, specs[node.name], kinds[node.name])
    names = {n: found.alias.get(n.name, n.name) for n in ep.graph.nodes}
    gradless = {n for n in placeholders if kinds[n.name] in ("buffer", "constant")}
    nodes = _nodes(ep, names, gradless, kinds)
    outputs, mutations = _outputs(ep, names)
    graph = wire.GraphSpec(inputs=found.inputs, nodes=nodes, outputs=outputs, dtype=_graph_dtype(found.param_dtypes),
                           constants=found.constants, buffer_mutations=mutations)
    return graph, found.weights


def _input_specs(ep: "torch.export.ExportedProgram") -> tuple[dict, dict[str, str]]:
    """Each placeholder's input spec and its kind on the wire ("parameter", "buffer", "constant", "input");
    a placeholder of another kind is refused."""
    from torch.export.graph_signature import InputKind

    wire_kinds = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
                  InputKind.CONSTANT_TENSOR: "constant", InputKind.USER_INPUT: "input"}
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    kinds = {}
    for node in ep.graph.nodes:
        if node.op != "placeholder":
            continue
        s = specs[node.name]
        if s.kind not in wire_kinds:
            raise UnsupportedModuleError(f"the exported graph has an input of kind {s.kind.name} ({node.name}); the "
                                         "service takes parameters, buffers, tensor constants and tensor inputs")
        kinds[node.name] = wire_kinds[s.kind]
    return specs, kinds


class _Inputs:
    """The exported graph's placeholders as the wire's inputs, with the weights and constants they name.
    Tied weights (GPT-2's lm_head.weight is transformer.wte.weight) are one placeholder per name in the
    exported graph; here they become one input, as one parameter, so its gradient sums both uses."""

    def __init__(self, ep: "torch.export.ExportedProgram", module: nn.Module, batched: list[bool]) -> None:
        self.ep, self.batched = ep, batched
        self.tensors = {**dict(module.named_parameters(remove_duplicate=False)),
                        **dict(module.named_buffers(remove_duplicate=False))}
        self.inputs: list[wire.GraphInput] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.constants: dict[str, wire.Tensor] = {}
        self.param_dtypes: set = set()
        self.alias: dict[str, str] = {}  # a tied weight's later placeholder -> the first one's name
        self.first_by_tensor: dict[int, str] = {}

    def add(self, node: "torch.fx.Node", spec, kind: str) -> None:
        val = node.meta.get("val")
        if kind == "input" and not isinstance(val, torch.Tensor):
            raise UnsupportedModuleError(f"input {node.name!r} is not a tensor; only tensor inputs are supported")
        entry = wire.GraphInput(name=node.name, kind=kind, target=spec.target)
        if kind in ("parameter", "buffer"):
            if not self._weight(node, spec, entry):
                return
        elif kind == "constant":
            self._constant(spec, entry)
        else:
            entry.target = None
            entry.dtype, entry.shape = _dtype(val), [int(n) if isinstance(n, int) else -1 for n in val.shape]
            entry.batch_dim = 0 if self.batched[sum(1 for i in self.inputs if i.kind == "input")] else None
            if val.layout in (torch.sparse_coo, torch.sparse_csr):
                entry.layout = str(val.layout).removeprefix("torch.")
        self.inputs.append(entry)

    def _weight(self, node: "torch.fx.Node", spec, entry: wire.GraphInput) -> bool:
        """A parameter's or buffer's input; False for a tied weight's second name (an alias of the first)."""
        t = self.tensors.get(spec.target)
        if t is None:
            t = self.ep.constants.get(spec.target)  # non-persistent buffers live among the constants
        if t is None:
            raise UnsupportedModuleError(f"{entry.kind} {spec.target!r} of the exported graph is not in the module")
        if id(t) in self.first_by_tensor:
            self.alias[node.name] = self.first_by_tensor[id(t)]
            return False
        self.first_by_tensor[id(t)] = node.name
        self.weights[spec.target] = t.detach()
        entry.dtype, entry.shape = _dtype(t), list(t.shape)
        if t.layout in (torch.sparse_coo, torch.sparse_csr):  # a sparse buffer travels as its parts
            entry.layout = str(t.layout).removeprefix("torch.")
        if entry.kind == "parameter":
            self.param_dtypes.add(t.dtype)
        return True

    def _constant(self, spec, entry: wire.GraphInput) -> None:
        c = self.ep.constants[spec.target]
        if not isinstance(c, torch.Tensor):
            raise UnsupportedModuleError(f"constant {spec.target!r} is a {type(c).__name__}, not a tensor")
        const = to_wire(c.detach().cpu().contiguous())
        self.constants[spec.target] = wire.Tensor(dtype=const.dtype, shape=const.shape, data=bytes(const.data))
        entry.dtype, entry.shape = _dtype(c), list(c.shape)


def _nodes(ep: "torch.export.ExportedProgram", names: dict, gradless: set, kinds: dict[str, str]) -> list[wire.OpNode]:
    """The graph's calls as wire nodes, grad-mode regions inlined (_Inliner), each named by its module."""
    inliner = _Inliner(ep, names, gradless)
    nodes = []
    for call in inliner.calls():
        _refuse_input_writes(call, kinds, inliner.origin)
        nodes.append(wire.OpNode(name=call.name, op=_op_name(call), args=[_arg(a, call, names) for a in call.args],
                                 kwargs={k: _arg(v, call, names) for k, v in call.kwargs.items()},
                                 **_module_of(call)))
    return nodes


def _outputs(ep: "torch.export.ExportedProgram", names: dict) -> tuple[list[dict], dict[str, str]]:
    """The model's outputs (tensors only) and the buffers its forward writes, each by its node's name."""
    from torch.export.graph_signature import OutputKind

    outputs, mutations = [], {}
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    for spec, value in zip(ep.graph_signature.output_specs, out_node.args[0]):
        if spec.kind == OutputKind.USER_OUTPUT:
            if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
                outputs.append({"node": names[value]})
            elif value is not None:
                raise UnsupportedModuleError(f"the model returns a non-tensor value ({value!r}); return tensors only")
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            mutations[spec.target] = names[value]
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            continue  # `x.div_(255)` in forward: the graph computes with the new value; the service's copy takes it
        else:
            raise UnsupportedModuleError(f"the exported graph has an output of kind {spec.kind.name} ({spec.target}); "
                                         "the service takes user outputs and buffer updates only (a forward must "
                                         "not modify its inputs)")
    if not outputs:
        raise UnsupportedModuleError("the model returns no tensor; return the output the loss applies to")
    return outputs, mutations


def _graph_dtype(param_dtypes: set) -> str:
    """The parameters' one floating dtype (torch's default for a model without floating parameters)."""
    floats = sorted({str(d).removeprefix("torch.") for d in param_dtypes if d.is_floating_point})
    if len(floats) > 1:
        raise UnsupportedModuleError(f"the model mixes parameter dtypes {floats}; convert it to one dtype first")
    return floats[0] if floats else str(torch.get_default_dtype()).removeprefix("torch.")


def _refuse_input_writes(node: "_Call", kinds: dict[str, str], origin: dict) -> None:
    """A forward that writes its input or a parameter in place cannot be replayed as a pure function of
    the weights and the batch (the service refuses it too); say so before anything is sent."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return
    for arg, value in zip(target._schema.arguments, node.args):
        if not isinstance(value, torch.fx.Node):
            continue
        value = origin.get(value, value)  # inside an inlined region: the value that entered it
        written = arg.alias_info is not None and arg.alias_info.is_write
        if written and value.op == "placeholder":
            kind = kinds.get(value.name)  # the exported graph's own placeholders' kinds (_input_specs)
            if kind in ("parameter", "constant"):
                raise UnsupportedModuleError(f"the model modifies its {kind} {value.name!r} in place ({target}); a "
                                             "forward must not modify its inputs or parameters: work on a copy")


@dataclass
class _Call:
    """One call to send, read like a torch.fx.Node: an exported node, or a detach where a value enters a
    no_grad region."""

    name: str
    target: object
    args: tuple
    kwargs: dict
    meta: dict


class _Inliner:
    """The exported graph's calls in order, with its grad-mode regions inlined as eager runs them, so the
    wire needs no region concept. torch.export puts the body of `with torch.no_grad():` (or
    `torch.set_grad_enabled(False)`) in a submodule called by `wrap_with_set_grad_enabled(False, submod,
    *args)`: here each tensor argument is detached (buffers and constants, which carry no gradient, are
    left as they are so that running statistics can be updated in place), the body's nodes follow, and
    the `getitem`s of its results read them directly. A region that turns grad back on inside a no_grad
    one, and autocast, are refused; an `autocast(enabled=False)` region runs as written."""

    def __init__(self, ep: "torch.export.ExportedProgram", names: dict, gradless: set) -> None:
        self.ep, self.names, self.gradless = ep, names, gradless
        self.origin: dict = {}  # a region's placeholder -> the outer value passed in (for the write checks)
        self.used = set(names.values())
        self.skipped: set = set()
        self.out: list[_Call] = []

    def calls(self) -> list[_Call]:
        self._walk(self.ep.graph, self.ep.graph_module, grad=True)
        return self.out

    def _unique(self, base: str) -> str:
        name, i = base[:180], 1
        while name in self.used:
            name, i = f"{base[:180]}_{i}", i + 1
        self.used.add(name)
        return name

    def _walk(self, graph: "torch.fx.Graph", owner: nn.Module, grad: bool) -> None:
        for node in graph.nodes:
            if node.op in ("placeholder", "output") or node in self.skipped:
                continue
            if node.op == "get_attr" and node.users and all(_is_region(u) for u in node.users):
                continue  # a region's body, inlined where the region is called
            if node.op != "call_function":
                raise UnsupportedModuleError(f"node {node.name!r} is a {node.op} ({node.target}); the service runs "
                                             "only calls of ATen ops (no higher-order ops: cond, map, checkpoint, "
                                             "...)")
            if _is_region(node):
                self._inline(node, owner, grad)
            else:
                self.out.append(_Call(self.names[node], node.target, node.args, node.kwargs, node.meta))

    def _inline(self, node: "torch.fx.Node", owner: nn.Module, grad: bool) -> None:
        if node.target is torch.ops.higher_order.wrap_with_autocast:
            device, dtype, enabled, _, body, *operands = node.args
            if enabled:
                raise _final(UnsupportedModuleError(
                    f"node {node.name!r}: forward runs a block under torch.autocast({device!r}, dtype={dtype}); the "
                    "service computes in the request's dtype (float32 or float64) and does not reproduce autocast's "
                    "mixed precision, so the gradients would differ. Remove the autocast block from forward (run "
                    "the module under autocast only locally), or cast explicitly with .to(dtype)"))
            detach = False
        else:
            enabled, body, *operands = node.args
            if enabled and not grad:
                raise UnsupportedModuleError(
                    f"node {node.name!r}: forward turns gradients back on (torch.enable_grad or "
                    "set_grad_enabled(True)) inside a no_grad block, which the exported graph cannot express; "
                    "end the no_grad block before that code instead")
            detach = not enabled
        bad_users = [u.name for u in node.users if u.target is not operator.getitem]
        if bad_users:
            raise UnsupportedModuleError(f"node {node.name!r} ({node.target.name()}): its results are read by "
                                         f"{bad_users} other than by index; the exporter cannot inline it")
        sub = getattr(owner, body.target)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for ph, value in zip(placeholders, operands):
            if not isinstance(value, torch.fx.Node):
                raise UnsupportedModuleError(f"node {node.name!r} passes the constant {value!r} into a grad-mode "
                                             "region; the exporter inlines regions of graph values only")
            self.origin[ph] = self.origin.get(value, value)
            inside = [u for u in ph.users if u.op != "output"]
            if detach and inside and isinstance(ph.meta.get("val"), torch.Tensor) and \
                    self.origin[ph] not in self.gradless:
                name = self._unique(f"{ph.name}_detached")
                self.out.append(_Call(name, torch.ops.aten.detach.default, (value,), {}, node.meta))
                self.names[ph] = name
            else:
                self.names[ph] = self.names[value]
        for inner in sub.graph.nodes:
            if inner.op not in ("placeholder", "output"):
                self.names[inner] = self._unique(inner.name)
        self._walk(sub.graph, sub, grad=grad and not detach)
        results = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        passed = dict(zip(placeholders, operands))
        for user in node.users:
            result = results[user.args[1]]
            # A value passed through unchanged is the caller's own tensor (as in eager), not its detached copy.
            self.names[user] = self.names[passed[result]] if result in passed else self.names[result]
            self.skipped.add(user)


def _final(exc: UnsupportedModuleError) -> UnsupportedModuleError:
    """A refusal the recording would not lift (autocast: the service does not reproduce mixed precision)."""
    exc.final = True
    return exc


def _is_region(node: "torch.fx.Node") -> bool:
    return node.op == "call_function" and node.target in (torch.ops.higher_order.wrap_with_set_grad_enabled,
                                                          torch.ops.higher_order.wrap_with_autocast)


def _dtype(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in wire.ITEMSIZE:
        raise UnsupportedModuleError(f"a tensor of dtype {t.dtype} cannot travel; use one of {', '.join(wire.DTYPES)}")
    return name


def _op_name(node: "torch.fx.Node") -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace == "gradsvc_fn":  # a custom autograd Function's call (functions.py)
            return f"function.{target._schema.name.split('::', 1)[1]}"
        if target in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):  # a value read:
            # export leaves it as an unbacked symbol; the recording specialises to the value, with a guard
            raise UnsupportedModuleError(f"node {node.name!r} reads a tensor's value ({target.name()}); the recording "
                                         "specialises to it instead")
        if target.namespace not in ("aten", "prims"):  # export keeps a library's torch.library op whole: the
            # recording (trace.py) runs through its Python implementation to the ATen ops the service runs
            raise UnsupportedModuleError(f"node {node.name!r} calls the library op {target.name()}, which the "
                                         "service does not run; its implementation is recorded instead")
        return f"{target.namespace}.{target._schema.name.split('::', 1)[1]}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        raise UnsupportedModuleError(f"node {node.name!r} calls the higher-order op {target.name()}; the service runs "
                                     "plain ATen ops only (no cond, map, checkpoint or custom autograd functions)")
    if getattr(operator, getattr(target, "__name__", ""), None) is target:
        return f"operator.{target.__name__}"
    return f"{getattr(target, '__module__', None) or '?'}.{getattr(target, '__name__', repr(target))}"


def _arg(a, node: "_Call", names: dict):
    if isinstance(a, torch.fx.Node):
        return {"node": names[a]}
    if isinstance(a, (list, tuple)):
        return [_arg(x, node, names) for x in a]
    return wire_constant(a, f"node {node.name!r} ({node.target})")


def wire_constant(a, where: str):
    """A non-tensor argument as the graph format carries it (export's and the recording's alike): a scalar as
    itself; a non-finite float, a dtype, device, layout or memory format as a one-key object; anything else is
    refused, `where` naming the call."""
    if isinstance(a, float) and not math.isfinite(a):
        return {"float": "nan" if math.isnan(a) else ("inf" if a > 0 else "-inf")}
    if isinstance(a, _SCALAR_TYPES):
        return a
    if isinstance(a, torch.device):
        return {"device": str(a)}
    for kind, key in ((torch.dtype, "dtype"), (torch.layout, "layout"), (torch.memory_format, "memory_format")):
        if isinstance(a, kind):
            return {key: str(a).removeprefix("torch.")}
    raise UnsupportedModuleError(f"{where} has an argument of type {type(a).__name__} ({a!r}), which the graph "
                                 "format cannot carry")


def state_dict_path(path: str) -> str:
    """"layer1.0.conv1" as it is; the Dynamo spelling "L['self'].layer1[0].conv1" (older torch) made so."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    return path.strip(".")


def _module_of(node: "torch.fx.Node") -> dict[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return {}
    path, kind = list(stack.values())[-1]
    if path.startswith("_empty_nn_module_stack"):
        return {}
    path = state_dict_path(path)
    name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
    return {"module": path, "module_type": name.rsplit(".", 1)[-1]}


@contextlib.contextmanager
def portable() -> Iterator[None]:
    """oneDNN off while the forward is recorded: a float32 RNN on a CPU then runs (and is recorded as) its portable
    ops, not `mkldnn_rnn_layer`, a kernel of this CPU build that the service's graphs do not take."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)
