"""The ATen program a forward executes on one batch, recorded as it runs: the capture that does not give up.

When torch.export cannot capture a module (a `torch.distributions` object validating its arguments, Python
control flow on a tensor's value, a tensor attribute assigned in forward, a boolean mask's data-dependent
shape), the forward is run once on a copy of this batch under a TorchDispatchMode that writes down every ATen
call below autograd, the same ops autograd itself records (each has a derivative formula where it has a
gradient). The graph is specialised: to the inputs' shapes and dtypes, to the values Python read out of
tensors (`item()`, `bool()`, `if t.sum() > 0`: `aten._local_scalar_dense`), and to the sizes of outputs whose
shape depends on values (`nonzero`, a boolean-mask index: the node carries the size it had, which the
service's shape check takes and its run checks). Those are its `guards`; `check_guards` replays the program's
prefix on a new batch to say whether they still hold, so the SDK reuses the graph (by its ref) only then.

Ops that run with grad off (`torch.no_grad()`) are followed by a detach, so the service differentiates what
eager differentiates. Buffers and tensor attributes the forward writes (in place, or by assignment,
`self.stats = h.mean(0)`) are the graph's `buffer_mutations`; the module, its buffers, the RNG and the
caller's inputs are left as they were.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from gradsvc import wire

from .errors import UnsupportedModuleError
from .graph import _dtype, portable, state_dict_path, wire_constant
from .module_state import owner_of, restore, snapshot, state_of
from .tensors import to_wire
from .through import DATA_DEPENDENT, op_name, recorded_through, specialised, writes_out

aten = torch.ops.aten
_SKIP = frozenset({"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default",
                   "aten._assert_async.msg", "aten._assert_async.default", "aten.sym_size.int",
                   "aten.sym_numel.default", "aten.sym_stride.int", "aten.sym_storage_offset.default"})


def _bool_index(func, args) -> bool:
    return func is aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                             for i in (args[1] if len(args) > 1 else ()))


@dataclass
class Recorded:
    """One recorded call: the op, its arguments with tensors as ("node", name) references."""

    name: str
    func: Any
    args: tuple
    kwargs: dict
    module: str = ""
    module_type: str = ""
    shape: list[int] | None = None  # the size of a data-dependent output, as it was


@dataclass
class Guards:
    """What a traced graph is specialised to: the inputs' shapes and dtypes, the values read from tensors by
    Python (node -> value) and the sizes of data-dependent outputs (node -> shape)."""

    inputs: list[tuple[list[int], str]] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, list[int]] = field(default_factory=dict)
    # Tensors made outside torch's ops in forward (torch.tensor(...), numpy): the graph holds their values, so it
    # is recorded again on every call (the SDK still reuses the service's copy when the recording is the same).
    constants: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"inputs": [{"shape": s, "dtype": d} for s, d in self.inputs], "values": dict(self.values),
                "sizes": dict(self.sizes), "constants": list(self.constants)}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: dict[int, str] = {}  # id(tensor) -> the node or input holding it
        self.keep: list = []  # every tensor named, so that its id is not reused during the run
        self.calls: list[Recorded] = []
        self.constants: dict[str, torch.Tensor] = {}
        self.guards = Guards()
        self.reads: list[tuple[int, tuple]] = []  # (calls before it, (func, args, kwargs, value)): Python's reads
        self.modules: list[tuple[str, str]] = [("", "")]
        self.storages: dict[tuple, str] = {}  # a state tensor's or input's memory -> its name (`w.data` reads)
        self.writes: dict[tuple, str] = {}  # memory -> the node an in-place op last wrote into it (any alias)
        self.buffer_memory: dict[tuple, str] = {}  # a buffer's memory -> its input name (`buf.data.mul_` writes it)
        self.functions: set[str] = set()  # the custom autograd Functions the forward applied (_functions_recorded)
        self.counts: dict[str, int] = {}
        self.used: set[str] = set()
        self.autograd_aliases: dict[str, str] = {}  # a detach node -> the node it detached (first of a chain)
        self.written_storages: set[int] = set()  # memory an in-place op wrote (a zeros tensor filled by setitem)
        self.through = 0  # how deep in library ops recorded through to ATen (through.recorded_through)

    def name(self, t: torch.Tensor, name: str) -> None:
        self.names[id(t)] = name
        self.used.add(name)
        self.keep.append(t)

    def _fresh(self, base: str) -> str:
        """A node name no other node or input has."""
        n = self.counts.get(base, 0)
        name = base if n == 0 else f"{base}_{n}"
        while name in self.used:
            n += 1
            name = f"{base}_{n}"
        self.counts[base] = n + 1
        self.used.add(name)
        return name

    def _ref(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            key = self.names.get(id(a))
            if key is None:
                key = self._unknown(a)
            elif a.grad_fn is not None and not (a.layout == torch.strided and
                                                 a.untyped_storage().data_ptr() in self.written_storages):
                # A detach's result that carries a grad_fn is not the user's detach (whose result has none): it is
                # autograd's own, which saves an op's output detached and gives it its grad_fn back when a backward
                # with create_graph=True unpacks it (tanh_backward(grad, result)). It stands for its source, so that
                # the second-order terms through it are kept. Not so once its memory was written in place: a
                # factory's result is handed out as such a detach, and `out = zeros(...); out[:, i] = y` gives it
                # the grad_fn of the write, which its source never had.
                key = self.autograd_aliases.get(key, key)
            return ("node", key)
        if isinstance(a, (list, tuple)):
            return type(a)(self._ref(x) for x in a)
        return a

    def _unknown(self, a: torch.Tensor) -> str:
        """A tensor no recorded call made: a known tensor under another object, else a tensor made outside torch's
        ops (`torch.tensor(...)`, numpy) in forward: a constant, which the graph is specialised to. A known tensor
        with a grad_fn is the same value to autograd: an op's output that autograd saved for backward and unpacked
        as a new object (a gradient taken with create_graph=True inside forward), whose second-order terms a
        constant would drop. One without is `w.data` of a known tensor: its detach."""
        known = self.storages.get(_memory(a)) if a.layout == torch.strided else None
        if known is not None and a.grad_fn is not None:
            self.name(a, known)
            return known
        if known is not None:
            d = Recorded(self._fresh(f"{known}_data"), aten.detach.default, (("node", known),), {}, *self.modules[-1])
            self.calls.append(d)
            self.name(a, d.name)
            return d.name
        return self._constant(a, "c_constant")

    def _constant(self, t: torch.Tensor, base: str) -> str:
        """`t` held as the constant it is on this batch: the graph is specialised to it (Guards.constants)."""
        key = self._fresh(base)
        self.constants[key] = t.detach().clone()
        self.guards.constants.append(key)
        self.name(t, key)
        return key

    def remember_storage(self, t: torch.Tensor, name: str) -> None:
        """`t`'s memory known as `name`: the first tensor named there keeps it (a later detach or alias of the same
        memory does not take it over)."""
        if t.layout == torch.strided:
            self.storages.setdefault(_memory(t), name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        through = recorded_through(func, kwargs)
        if through is not None:
            self.through += 1  # a library op's autograd runs its implementation with grad off: not a no_grad region
            try:
                with self:  # the mode again, so that the ATen calls made in there are recorded
                    return through(*args, **kwargs)
            finally:
                self.through -= 1
        out = func(*args, **kwargs)
        if specialised(func, args, kwargs, out):
            return self._specialise(out)
        if args and isinstance(args[0], torch.Tensor) and args[0].layout == torch.strided and \
                isinstance(func, torch._ops.OpOverload) and _writes_first(func):
            self.written_storages.add(args[0].untyped_storage().data_ptr())
        if self.through and func is aten.detach.default and id(args[0]) in self.names:
            self.name(out, self.names[id(args[0])])  # inside a library op's implementation: the same value
            return out
        name = op_name(func)
        if name in _SKIP or not isinstance(func, torch._ops.OpOverload):
            if name in ("aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"):
                read = (func, self._ref(tuple(args)), {k: self._ref(v) for k, v in kwargs.items()},
                        out if isinstance(out, (bool, int)) else float(out))
                self.reads.append((len(self.calls), read))
                self.guards.values[f"{name.split('.')[1]}({', '.join(_shown(a) for a in read[1])})"] = read[3]
            return out
        module, module_type = self.modules[-1]
        rec = Recorded(self._fresh(func._schema.name.split("::", 1)[1].replace(".", "_")), func,
                       self._written_through(func, args), {k: self._ref(v) for k, v in kwargs.items()}, module,
                       module_type)
        self.calls.append(rec)
        if func is aten.detach.default and rec.args and isinstance(rec.args[0], tuple) and rec.args[0][0] == "node":
            source = rec.args[0][1]
            self.autograd_aliases[rec.name] = self.autograd_aliases.get(source, source)
        if name in DATA_DEPENDENT or _bool_index(func, args):
            rec.shape = list(out.shape)
            self.guards.sizes[rec.name] = rec.shape
        self._name_outputs(func, rec, out, args)
        return out

    def _specialise(self, out: Any) -> Any:
        """`out`'s tensors held as the constants they are on this batch (through.SPECIALISED), so that the graph is
        recorded again on every call."""
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._constant(t, "c_specialised")
        return out

    def _written_through(self, func, args: tuple) -> tuple:
        """The call's arguments; an in-place write into a buffer's memory through another alias of it (`buf.data`,
        a detach: EMA codebooks) writes the buffer itself (its latest value), as eager does."""
        refs = self._ref(tuple(args))
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.layout == torch.strided and _writes_first(func):
            buffer = self.buffer_memory.get(_memory(first))
            if buffer is not None:
                refs = (("node", self.writes.get(_memory(first), buffer)), *refs[1:])
        return refs

    def _name_outputs(self, func, rec: Recorded, out: Any, args: tuple) -> None:
        detach = not torch.is_grad_enabled() and not self.through and not _writes_first(func)
        if isinstance(out, torch.Tensor):
            self._name_output(out, self._detached(rec, out) if detach else rec.name)
        elif isinstance(out, (tuple, list)):
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    item = Recorded(self._fresh(f"{rec.name}_{i}"), operator.getitem, (("node", rec.name), i), {},
                                    rec.module, rec.module_type)
                    self.calls.append(item)
                    self._name_output(t, self._detached(item, t) if detach else item.name)

    def _name_output(self, t: torch.Tensor, name: str) -> None:
        if id(t) in self.names:  # an in-place op's result: the tensor it wrote, now holding this node's value
            self.names[id(t)] = name
            if t.layout == torch.strided:
                self.storages[_memory(t)] = self.writes[_memory(t)] = name
            return
        self.name(t, name)
        self.remember_storage(t, name)

    def _detached(self, rec: Recorded, t: torch.Tensor) -> str:
        if not t.is_floating_point() and not t.is_complex():
            return rec.name
        d = Recorded(self._fresh(f"{rec.name}_detached"), aten.detach.default, (("node", rec.name),), {},
                     rec.module, rec.module_type)
        self.calls.append(d)
        return d.name


def _wire_name(target: str, params: set) -> str:
    """A parameter's or buffer's name in the graph (names are [A-Za-z0-9_]), as export names them."""
    return ("p_" if target in params else "b_") + re.sub(r"[^A-Za-z0-9_]", "_", target)


@dataclass
class Traced:
    graph: wire.GraphSpec
    weights: dict[str, torch.Tensor]
    guards: Guards
    calls: list[Recorded]
    out_spec: Any
    state_kinds: dict[str, str]
    reads: list = field(default_factory=list)  # _Recorder.reads: the values Python read, replayed by check_guards
    constants: dict = field(default_factory=dict)
    input_names: list = field(default_factory=list)  # each input leaf's name in the graph (_input_names)
    # The custom autograd Functions the forward calls: recorded as their forward's ops, so the recording's gradient
    # is their forward's derivative; sent only when it equals their own backward's (replay.verify_recording).
    functions: list = field(default_factory=list)


def trace_graph(module: nn.Module, args: tuple, kwargs: dict, batched: list[bool]) -> Traced:
    """The forward run once on a copy of this batch, its ATen calls recorded (module docstring)."""
    state = state_of(module)
    snap = snapshot(module)
    params, saved, attrs = snap.params, snap.saved, snap.attrs
    xs, tree = pytree.tree_flatten((args, kwargs))
    copies = [x.detach().clone() for x in xs]
    rec = _Recorder()
    versions = {n: t._version for n, t in state.items()}
    hooks = _module_hooks(module, rec)
    try:
        for n, t in state.items():
            if id(t) not in rec.names:  # a tied weight: its first name
                rec.name(t, _wire_name(n, params))
                rec.remember_storage(t, _wire_name(n, params))
                if n not in params and t.layout == torch.strided:
                    rec.buffer_memory[_memory(t)] = _wire_name(n, params)
        names = _input_names(args, kwargs, taken=set(rec.used))
        for x, name in zip(copies, names):
            rec.name(x, name)
            rec.remember_storage(x, name)
        rec.guards.inputs = [(list(x.shape), _dtype(x)) for x in copies]
        c_args, c_kwargs = pytree.tree_unflatten(copies, tree)
        with portable(), _functions_recorded(rec), rec:
            out = module(*c_args, **c_kwargs)
        written = _written(module, state, attrs, versions, rec, saved)
        outs, out_spec = pytree.tree_flatten(pytree.tree_map(_tensor_or_none, out))
        functions = sorted(rec.functions)
        graph, weights, kinds = _to_graph(rec, state, params, list(zip(names, copies, batched)), outs, written)
    except UnsupportedModuleError:
        raise
    except Exception as exc:  # noqa: BLE001  (the forward's own error, as it would raise locally)
        raise UnsupportedModuleError(f"the forward of {type(module).__name__} fails on this batch: "
                                     f"{type(exc).__name__}: {str(exc)[:600]}") from None
    finally:
        for h in hooks:
            h.remove()
        restore(module, snap)
    return Traced(graph=graph, weights=weights, guards=rec.guards, calls=rec.calls, out_spec=out_spec,
                  state_kinds=kinds, reads=rec.reads, constants=dict(rec.constants), input_names=names,
                  functions=functions)


def _memory(t: torch.Tensor) -> tuple:  # where a strided tensor's values are: two objects there hold one value
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _tensor_or_none(value: Any) -> Any:
    """An output leaf as the graph returns it: a tensor, else null (a Hugging Face model's key-value cache object,
    a count): the graph computes tensors, and a loss is one of them."""
    return value if isinstance(value, torch.Tensor) else None


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _input_names(args: tuple, kwargs: dict, taken: set[str]) -> list[str]:
    """Each input leaf's name in the graph: a keyword input that is one tensor by its keyword, as torch.export
    names it and as a request's named inputs (`{"input_ids": ..., "attention_mask": ...}`) say it; every other
    leaf (positional, or inside a nested keyword input) `input_{i}`, its place in the flattened inputs."""
    names: list[str] = []
    for i, (path, _) in enumerate(pytree.tree_flatten_with_path((args, kwargs))[0]):
        key = getattr(path[1], "key", None) if len(path) == 2 and getattr(path[0], "idx", None) == 1 else None
        name = key if isinstance(key, str) and _IDENTIFIER.fullmatch(key) else f"input_{i}"
        if name in taken:
            name = f"input_{i}"
        taken.add(name)
        names.append(name)
    return names


@contextlib.contextmanager
def _functions_recorded(rec: _Recorder) -> Iterator[None]:
    """A custom autograd Function's forward, which autograd runs with grad off, recorded as differentiable ops (as
    a library op's implementation is): the recording's gradient is then its forward's derivative, which
    replay.verify_recording holds against the Function's own backward before the recording is sent."""
    function = torch.autograd.function.Function
    original = function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls.__module__.startswith("torch"):
            return original.__get__(None, cls)(*args, **kwargs)
        rec.functions.add(cls.__name__)
        rec.through += 1
        try:
            return original.__get__(None, cls)(*args, **kwargs)
        finally:
            rec.through -= 1

    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original


def _module_hooks(module: nn.Module, rec: _Recorder) -> list:
    hooks = []
    for path, sub in module.named_modules():
        if path == "":
            continue

        def pre(_m, _a, path=path, kind=type(sub).__name__):
            rec.modules.append((state_dict_path(path), kind))

        def post(_m, _a, _o):
            if len(rec.modules) > 1:
                rec.modules.pop()

        hooks.append(sub.register_forward_pre_hook(pre))
        hooks.append(sub.register_forward_hook(post))
    return hooks


def _written(module: nn.Module, state: dict, attrs: dict, versions: dict, rec: _Recorder,
             saved: dict) -> dict[str, str]:
    """State the forward wrote -> the node whose value it takes: written in place (its version moved), or an
    attribute assigned a new tensor (`self.stats = h.mean(0)`)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    out = {}
    for n, old in attrs.items():
        now = getattr(*owner_of(module, n))
        if n in params:
            if old._version != versions[n] or now is not old:
                raise UnsupportedModuleError(f"the forward writes its parameter {n!r}; a forward must not modify "
                                             "its parameters (the optimizer does)")
            continue
        if now is not old and isinstance(now, torch.Tensor):
            key = rec.names.get(id(now))
            if key is None:
                continue
            owner, attr = owner_of(module, n)
            if (now.shape != old.shape or now.dtype != old.dtype) and attr not in owner._buffers:
                continue  # a plain attribute of another shape (`self.last_attn = attn`): not state a step carries
            if now.shape != old.shape or now.dtype != old.dtype:
                raise UnsupportedModuleError(f"the forward assigns {n!r} a {now.dtype} tensor of shape "
                                             f"{list(now.shape)} where the buffer held {old.dtype} {list(old.shape)}; "
                                             "a buffer written in forward keeps its shape and dtype")
            out[n] = key
        elif n in saved and old._version == versions[n] and old.layout == torch.strided and \
                not torch.equal(old, saved[n][1]) and not _passed(rec, _wire_name(n, params)):
            if _memory(old) not in rec.writes:
                raise UnsupportedModuleError(f"the forward writes {n!r} outside torch's ops, which no capture can "
                                             "follow: write the buffer in place under `with torch.no_grad():` "
                                             "instead (`self.ema.mul_(d).add_(x)`), or assign it (`self.ema = ...`)")
            out[n] = rec.writes[_memory(old)]  # through `.data`: the last value written into its memory
        elif old.layout == torch.strided and (old._version != versions[n] or not torch.equal(old, saved[n][1])):
            # Written in place (batch norm's running statistics, `ema.mul_(d)`): its value after the forward.
            wire_name = _wire_name(n, params)
            after = Recorded(rec._fresh(f"{wire_name}_after"), aten.alias.default, (("node", wire_name),), {})
            rec.calls.append(after)
            out[n] = after.name
    return out


def _writes_first(func) -> bool:
    """Whether the op writes its first argument in place (`mul_`, `add_`, `copy_`)."""
    arguments = func._schema.arguments
    return bool(arguments and arguments[0].alias_info and arguments[0].alias_info.is_write)


def _passed(rec: _Recorder, name: str) -> bool:
    """Whether a recorded call took the tensor itself (batch norm's kernel writes its running statistics
    without moving their version counter)."""
    ref = ("node", name)
    return any(ref in pytree.tree_leaves((c.args, c.kwargs), is_leaf=_is_ref) for c in rec.calls
               if c.func not in (aten.detach.default, aten.alias.default))  # a read of `.data` writes nothing


def _shown(a: Any) -> str:
    return a[1] if _is_ref(a) else repr(a)


def _wire_arg(a: Any) -> Any:
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "node":
        return {"node": a[1]}
    if isinstance(a, (list, tuple)):
        return [_wire_arg(x) for x in a]
    return wire_constant(a, "a recorded call")


def _to_graph(rec: _Recorder, state: dict, params: set, user_inputs: list[tuple[str, torch.Tensor, bool]], outs: list,
              written: dict[str, str]) -> tuple[wire.GraphSpec, dict[str, torch.Tensor], dict[str, str]]:
    used = {a[1] for c in rec.calls for a in pytree.tree_leaves((c.args, c.kwargs), is_leaf=_is_ref) if _is_ref(a)}
    out_names = []
    for o in outs:
        if not isinstance(o, torch.Tensor):
            if o is None:
                continue
            raise UnsupportedModuleError(f"the model returns a non-tensor value ({o!r}); return tensors only")
        key = rec.names.get(id(o))
        if key is None:
            raise UnsupportedModuleError("the model returns a tensor its forward did not compute")
        out_names.append(key)
        used.add(key)
    used.update(_wire_name(n, params) for n in written)
    inputs, weights, kinds, param_dtypes, seen = [], {}, {}, set(), set()
    for n, t in state.items():
        if _wire_name(n, params) not in used or id(t) in seen:
            continue
        seen.add(id(t))
        kind = "parameter" if n in params else "buffer"
        if kind == "parameter" and t.is_floating_point():
            param_dtypes.add(t.dtype)
        inputs.append(wire.GraphInput(name=_wire_name(n, params), kind=kind, target=n, dtype=_dtype(t),
                                      shape=list(t.shape), layout=_layout(t)))
        weights[n] = t.detach()
        kinds[n] = kind
    for name, x, batched in user_inputs:  # (name, tensor, whether it has a batch dimension)
        entry = wire.GraphInput(name=name, kind="input", dtype=_dtype(x), shape=list(x.shape),
                                batch_dim=0 if batched else None)
        entry.layout = _layout(x)
        inputs.append(entry)
    constants = {}
    for key, c in rec.constants.items():
        w = to_wire(c.cpu().contiguous() if c.layout == torch.strided else c.cpu())
        constants[key] = w if isinstance(w, wire.Tensor) else wire.Tensor(dtype=w.dtype, shape=w.shape, data=bytes(w.data))
        inputs.append(wire.GraphInput(name=key, kind="constant", target=key, dtype=_dtype(c), shape=list(c.shape)))
    nodes = [_node(c) for c in _live(rec.calls, set(out_names) | set(written.values()))]
    floats = sorted({str(d).removeprefix("torch.") for d in param_dtypes})
    if len(floats) > 1:
        raise UnsupportedModuleError(f"the model mixes parameter dtypes {floats}; convert it to one dtype first")
    dtype = floats[0] if floats else str(torch.get_default_dtype()).removeprefix("torch.")
    graph = wire.GraphSpec(inputs=inputs, nodes=nodes, outputs=[{"node": k} for k in out_names], dtype=dtype,
                           constants=constants, buffer_mutations=dict(written))
    return graph, weights, kinds


_EFFECTS = ("rand", "normal", "bernoulli", "uniform", "multinomial", "dropout", "randint", "randperm")


def _live(calls: list[Recorded], wanted: set[str]) -> list[Recorded]:
    """The calls the outputs and the state written need, those that write in place (through views, the values
    they write may be read), and random draws (the seed's stream, as eager consumes it); autograd's own
    detaches of saved outputs and other dead calls left out."""
    keep, need = [], set(wanted)
    for c in reversed(calls):
        writes = isinstance(c.func, torch._ops.OpOverload) and any(
            a.alias_info is not None and a.alias_info.is_write for a in c.func._schema.arguments)
        random = isinstance(c.func, torch._ops.OpOverload) and any(e in c.func._schema.name for e in _EFFECTS)
        if c.name in need or writes or random:
            keep.append(c)
            need.update(a[1] for a in pytree.tree_leaves((c.args, c.kwargs), is_leaf=_is_ref) if _is_ref(a))
    return keep[::-1]


def _layout(t: torch.Tensor) -> str | None:
    if t.layout in (torch.sparse_coo, torch.sparse_csr):
        return str(t.layout).removeprefix("torch.")
    if t.layout != torch.strided:
        raise UnsupportedModuleError(f"a {str(t.layout).removeprefix('torch.')} tensor cannot travel; use a dense, "
                                     "sparse COO or sparse CSR one")
    return None


def _is_ref(a: Any) -> bool:
    return isinstance(a, tuple) and len(a) == 2 and a[0] == "node"


def _node(c: Recorded) -> wire.OpNode:
    op = "operator.getitem" if c.func is operator.getitem else op_name(c.func)
    node = wire.OpNode(name=c.name, op=op, args=[_wire_arg(a) for a in c.args],
                       kwargs={k: _wire_arg(v) for k, v in c.kwargs.items()}, module=c.module, module_type=c.module_type)
    if c.shape is not None:
        node.shape = c.shape
    return node
