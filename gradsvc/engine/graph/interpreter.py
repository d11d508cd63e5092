"""The graph interpreter: a compiled graph (program.py) as an nn.Module, GraphModel, whose forward runs the
steps in order, each value dropped after its last use as eager Python drops it; load_weights fills it.

For the memory table, `GraphModel.node_modules[i]` is node i's (name, module path, module type) and,
while `track_modules` is True, `current_module` / `current_module_type` hold the running node's
module path and class name (a saved-tensors hook reads them to attribute saved bytes).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch
from torch import nn

from .. import tensors
from ..errors import SpecError
from .ops import drawn_in
from .program import DEVICE, DTYPES, Compiled, FloatDType, Ref, bad_graph
from .sparse import load_state


# Stop-gradients: autograd's derivative holds their values fixed, so the numerical check does too (and every
# value computed from held values alone without a gradient: a no_grad region's, see GraphModel.held).
HELD_OPS = frozenset({"aten.detach.default"})


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
        self.current_module = self.current_module_type = ""
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
        # The numerical check's held values (None: every node runs). The first forward after `hold()` records
        # them: each detach node's value, and each value computed without a gradient from held values (the
        # body of a `torch.no_grad()` region, which the SDK inlines with a detach of each value entering it:
        # a target network, an EMA teacher); every later forward returns the recorded value, the node unrun.
        self.held: dict[int, Any] | None = None
        self._recording, self._held_ids = False, collections.Counter()  # and the held tensors' ids (_record_held)
        self._readers, self._quiet = {}, set()  # hold(): _readers_of; held steps replayed quietly (_release_held)
        self.hold_steps = frozenset(i for i, s in enumerate(compiled.steps) if s.op.name in HELD_OPS)
        self.padding_steps, self._held_padding = _padding_steps(compiled), {}  # held too (_hold_padding)
        self.visit: Callable | None = None  # run's `visit` for every forward (the numerical check counts its work)
        self.before: Callable | None = None  # before(step_index, args, kwargs) ahead of each node (the check's)
        self.failed_node, self.failed_args = None, []  # after a failed run: the node's index and its arguments
        for slot, inp in compiled.inputs:
            if inp.kind == "input":
                self._users.append(slot)
            elif inp.kind == "constant":
                self._consts.append((slot, inp.target))
            else:
                owner, attr = self._owner(inp.target)
                want = DTYPES[inp.dtype]
                if want.is_floating_point and (dtype == torch.float64 or want == compiled.dtype):
                    want = dtype
                elif want.is_complex and (dtype == torch.float64 or want.to_real() == compiled.dtype):
                    want = _complex_of(dtype)
                make = torch.empty if str(device) == "meta" else torch.zeros  # never uninitialised memory
                t = make(inp.shape, dtype=want, device=device)
                try:
                    if inp.kind == "parameter":
                        owner.register_parameter(attr, nn.Parameter(t))
                        self._probe = self._probe or (owner, attr)
                    else:
                        owner.register_buffer(attr, t)
                except (KeyError, TypeError) as exc:
                    raise bad_graph(f"{inp.kind} {inp.target!r} cannot be registered: {exc}", "bad_weights",
                               parameter=inp.target) from None
                self._holders.append((slot, inp.kind, owner, attr))
                holder[inp.target] = (owner, attr)
        self._mutations = [(*holder[target], slot) for target, slot in compiled.mutations]
        self._holder_of = holder

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """nn.Module.load_state_dict, a sparse buffer set as it is (sparse.load_state)."""
        return load_state(super().load_state_dict, self._holder_of, state_dict, strict, assign)

    def _owner(self, target: str) -> tuple[nn.Module, str]:
        *path, attr = target.split(".")
        owner: nn.Module = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                if hasattr(owner, part):
                    raise bad_graph(f"{target!r}: {part!r} clashes with an attribute of the graph model; rename the "
                               "submodule", "bad_weights", parameter=target)
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        if attr in owner._modules:
            raise bad_graph(f"{target!r} is also a module prefix of other parameters", "bad_weights", parameter=target)
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
            as_captured = dtype == captured and not self.upcast_all

            def fix(a: Any) -> Any:
                if isinstance(a, FloatDType):
                    return _run_dtype(a.dtype, dtype, captured, as_captured)
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
                if not as_captured and "dtype" not in kwargs and _makes_default_float(s.op.name, args, kwargs):
                    # torch.zeros(n) in forward names no dtype: torch's default (float32) at capture, which
                    # stands for the captured dtype as a named one does (an index_put of float64 values into
                    # it in the check's float64 run would otherwise refuse the dtypes).
                    kwargs["dtype"] = _run_dtype(torch.get_default_dtype(), dtype, captured, as_captured)
                refs = tuple(i for i, a in enumerate(args) if _has_ref(a))
                krefs = tuple(k for k, v in kwargs.items() if _has_ref(v))
                fn = s.op.fn
                if s.op.random and not as_captured:
                    asked = s.kwargs.get("dtype")
                    fn = drawn_in(s.op, asked.dtype if isinstance(asked, FloatDType) else captured)
                steps.append((s.slot, fn, args, kwargs, refs, krefs, s.writes_buffer, s.op.is_assert, frees[i]))
            consts = [(slot, _run_constant(self._graph.constants[target], dtype, captured).to(device))
                      for slot, target in self._consts]
            prog = (steps, consts)
            self._programs[key] = prog
        return prog

    def to(self, *args: Any, **kwargs: Any) -> GraphModel:
        """nn.Module.to, except that a complex buffer (a rotary table) follows a floating dtype as its complex twin
        (float64: complex128: the check's copy) where nn.Module.to would cast it to the real dtype, losing its half."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None or not dtype.is_floating_point:
            return super().to(*args, **kwargs)
        held = [(owner, attr, owner._buffers[attr]) for _, kind, owner, attr in self._holders
                if kind == "buffer" and owner._buffers[attr] is not None and owner._buffers[attr].is_complex()]
        for owner, attr, _ in held:
            owner._buffers[attr] = None  # nn.Module._apply leaves a None buffer alone
        try:
            super().to(*args, **kwargs)
        finally:
            for owner, attr, t in held:
                owner._buffers[attr] = t.to(device=device or t.device, dtype=_complex_of(dtype))
        return self

    def hold(self) -> None:
        """The next forward records the values the numerical check holds (`held`); later ones replay them."""
        self.held, self._recording, self._held_ids = {}, True, collections.Counter()
        self._held_padding, self._readers, self._quiet = {}, _readers_of(self._graph), set()

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.run(*inputs, visit=self.visit)[0]

    def run(self, *inputs: torch.Tensor, visit: Callable | None = None) -> list:
        """Every user output; `visit(step_index, value, args, kwargs)` is called after each node (meta checks);
        a value it returns replaces the node's (the numerical check's simulated rounding)."""
        if len(inputs) != len(self._users):
            raise TypeError(f"the graph takes {len(self._users)} input(s), got {len(inputs)}")
        steps, consts = self._program(self.run_dtype, inputs[0].device)
        env = self._environment(inputs, consts)
        self._execute(steps, env, visit)
        for owner, attr, slot in self._mutations:
            buf = getattr(owner, attr)
            if not _same_memory(env[slot], buf):  # a recording's alias of a buffer its op wrote in place: written
                with torch.no_grad():
                    buf.copy_(env[slot])
        return [_fill(o, env) for o in self._graph.outputs]

    def _environment(self, inputs: tuple[torch.Tensor, ...], consts: list) -> list[Any]:
        """The slots before the first step: parameters and buffers, constants, the user's inputs."""
        env: list[Any] = [None] * self._graph.n_slots
        for slot, _, owner, attr in self._holders:
            env[slot] = getattr(owner, attr)  # not _parameters[attr]: torch.func.functional_call swaps attributes
        for slot, value in consts:  # a constant a node writes in place (`mask |= hit`): this run's copy
            env[slot] = value.clone() if slot in self._graph.written_inputs else value
        for slot, x in zip(self._users, inputs):
            # Complex inputs follow the run dtype as floating ones do where the job casts them (float64: the
            # check's copy), so that view_as_real of them meets parameters of the same dtype.
            env[slot] = _run_constant(x, self.run_dtype, self._graph.dtype) if x.is_complex() else x
            if slot in self._graph.written_inputs:  # `x.div_(255)` in forward: on this run's copy, not the batch
                env[slot] = env[slot].clone()
        return env

    def _execute(self, steps: list, env: list[Any], visit: Callable | None) -> None:
        """Runs the steps over `env`; a step that raises is kept as failed_node, with its arguments."""
        track = self.track_modules
        node_modules = self.node_modules
        held, before = self.held, self.before
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
                if held is not None and i in self._quiet and not self._recording:
                    _replay_quietly(self, i, slot, env, free)  # reads a value that was not kept, or is one
                    continue
                if before is not None:
                    before(i, args, kwargs)
                if held is not None and i in held and not self._recording:
                    out = _detached(held[i])  # written since with values that train (`boxes[keep] = x`): not its graph
                elif writes_buffer:
                    with torch.no_grad():
                        out = fn(*args, **kwargs)
                else:
                    out = fn(*args, **kwargs)
                if held is not None and i in self.padding_steps:
                    out = _hold_padding(self, i, out, args[1])
                if self._recording:
                    _record_held(self, i, out, args, kwargs, writes_buffer)
                if visit is not None:
                    seen = visit(i, out, args, kwargs)
                    out = out if seen is None else seen
                env[slot] = out
                for j in free:  # as eager Python drops a value after its last use (peak memory)
                    env[j] = None
                    if self._recording:
                        _release_held(self, j)
        except Exception:
            self.failed_node = i
            self.failed_args = [*args, *kwargs.values()] if i >= 0 else []
            raise
        finally:
            self._recording = False
            if track:
                self.current_module = self.current_module_type = ""


def _run_dtype(d: torch.dtype, dtype: torch.dtype, captured: torch.dtype, as_captured: bool) -> torch.dtype:
    """The dtype a graph's floating or complex dtype argument names in a run in `dtype`."""
    if as_captured:
        return d  # the model as captured: its own casts (float32 RMSNorm, rotary) stay
    if d.is_complex:
        return _complex_of(_run_dtype(d.to_real(), dtype, captured, as_captured))
    return torch.float64 if dtype == torch.float64 else (dtype if d == captured else d)


# Factories whose result, with no dtype named, is torch's default floating dtype; full and arange only when a value
# they take is a float (torch.full((2,), 1) and torch.arange(3) are int64).
_DEFAULT_FLOAT_FACTORIES = frozenset({"aten.zeros.default", "aten.ones.default", "aten.empty.memory_format",
                                      "aten.rand.default", "aten.randn.default", "aten.eye.default", "aten.eye.m",
                                      "aten.linspace.default", "aten.logspace.default", "aten.scalar_tensor.default"})
_FLOAT_WHEN_GIVEN_A_FLOAT = frozenset({"aten.full.default", "aten.arange.default", "aten.arange.start",
                                       "aten.arange.start_step"})


def _makes_default_float(name: str, args: tuple, kwargs: dict) -> bool:
    if name in _DEFAULT_FLOAT_FACTORIES:
        return True
    return name in _FLOAT_WHEN_GIVEN_A_FLOAT and any(isinstance(a, float) for a in (*args, *kwargs.values()))


def _padding_steps(compiled: Compiled) -> dict[int, int]:
    """The embedding steps with a padding row, by step: {index: padding_idx}. Autograd defines that row's gradient as
    0 although the forward reads it, so the check holds the output at padding positions at its unperturbed value,
    as it holds a detach's (_hold_padding)."""
    return {i: pad for i, s in enumerate(compiled.steps) if (pad := _padding_idx(s)) is not None}


def _hold_padding(model: GraphModel, i: int, out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Embedding step i's output with its padding positions' rows as the recording forward had them."""
    if model._recording:
        model._held_padding[i] = out.detach()
        return out
    return torch.where((ids == model.padding_steps[i]).unsqueeze(-1), model._held_padding[i], out)


def _padding_idx(step) -> int | None:
    """An embedding step's padding_idx when it names a row (aten.embedding(weight, ids, padding_idx, ...))."""
    if step.op.name != "aten.embedding.default":
        return None
    pad = step.args[2] if len(step.args) > 2 else step.kwargs.get("padding_idx", -1)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 else None


def _complex_of(dtype: torch.dtype) -> torch.dtype:
    # complex32 (float16's twin) lacks most kernels: complex values stay complex64 below float64.
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def _run_constant(c: torch.Tensor, dtype: torch.dtype, captured: torch.dtype) -> torch.Tensor:
    if c.is_floating_point() and (dtype == torch.float64 or c.dtype == captured):
        return c.to(dtype)
    if c.is_complex() and (dtype == torch.float64 or c.dtype.to_real() == captured):
        return c.to(_complex_of(dtype))
    return c


# A held value that no later forward reads (GraphModel.held): every step reading it is held too, so its node
# is skipped in those forwards and its memory goes at its last use, as a value that is not held does.
UNREAD = object()


def _replay_quietly(model: GraphModel, i: int, slot: int, env: list, free: tuple) -> None:
    """A held step whose value was not kept (UNREAD), or that reads one: its held value (or nothing) without
    running it or calling the hooks (`before`, `visit`), whose arguments it no longer has. The check's rounding
    simulation therefore leaves such a value as float64 computed it: it is the end of a chain without a gradient
    (Mask R-CNN's mask targets), a constant of every evaluation."""
    value = model.held[i]
    env[slot] = None if value is UNREAD else _detached(value)
    for j in free:
        env[j] = None


def _record_held(model: GraphModel, i: int, out: Any, args: Any, kwargs: Any, writes_buffer: bool) -> None:
    """In the recording forward: holds node i's value if it is a stop-gradient's, or has no gradient and reads a
    held value; a copy where the node writes a buffer in place (its value is the buffer, which later forwards
    rewrite)."""
    outs = _tensors(out)
    if not outs:
        return
    if i not in model.hold_steps:
        if any(t.requires_grad for t in outs):
            return
        if not any(id(t) in model._held_ids for t in _tensors([args, list(kwargs.values())])):
            return
    model.held[i] = _cloned(out) if writes_buffer else out
    model._held_ids.update(id(t) for t in outs)


def _release_held(model: GraphModel, slot: int) -> None:
    """In the recording forward, at a value's last use: a held value that only held steps read is not kept (a
    Mask R-CNN's targets, roi_align's decomposition on the ground-truth masks, took 200 MB a node and over 18 GB
    in all in float64). Its ids leave the held set with it unless another held value is the same tensor (an
    in-place op's), so that a later tensor given a freed one's id is not taken for a held one. A buffer write's
    value (a copy of the buffer, its ids the buffer's) stays."""
    step, readers = model._readers.get(slot, (None, ()))
    if (step is None or step not in model.held or model._graph.steps[step].writes_buffer
            or not all(r in model.held for r in readers)):
        return
    value, model.held[step] = model.held[step], UNREAD
    model._quiet.update((step, *readers))
    ids = model._held_ids
    for t in _tensors(value):
        ids[id(t)] -= 1
        if ids[id(t)] <= 0:
            del ids[id(t)]


def _readers_of(graph: Compiled) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Each node's slot: (the step that makes its value, the steps that read it, in order)."""
    readers: dict[int, list[int]] = {}
    for i, s in enumerate(graph.steps):
        for r in {r.i for r in _refs([*s.args, *s.kwargs.values()])}:
            readers.setdefault(r, []).append(i)
    return {s.slot: (i, tuple(readers.get(s.slot, ()))) for i, s in enumerate(graph.steps)}


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


def _same_memory(value: Any, buf: torch.Tensor) -> bool:
    """`value` is `buf`, or a view of all of it (a recording's `alias` of a buffer that native_batch_norm updated
    in place). Copying it onto itself would bump the buffer's version, which the op saved for backward."""
    if value is buf:
        return True
    return (isinstance(value, torch.Tensor) and value.layout == buf.layout == torch.strided and
            value.data_ptr() == buf.data_ptr() and value.shape == buf.shape and value.stride() == buf.stride()
            and value.dtype == buf.dtype)


def _detached(value: Any) -> Any:
    """A held value as the next run reads it: its memory, without the graph an earlier run gave it by writing into it
    in place with values that train (Faster R-CNN's detached proposals), whose backward has freed that graph."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value.requires_grad else value
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) and v.requires_grad for v in value):
        return type(value)(_detached(v) for v in value)
    return value


def _cloned(value: Any) -> Any:
    """`value` with each tensor in it (a list or tuple of them, nested) copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value, a list or a tuple of them (nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _fill(a: Any, env: list) -> Any:
    if type(a) is Ref:
        return env[a.i]
    if type(a) is list:
        return [_fill(x, env) for x in a]
    return a



def buffers_of(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The buffers `names` of a model: a GraphModel's through its holders (a dict look-up each, where get_buffer
    walks the module path: 2-3 ms of a job for timm's 300 batch-norm buffers), any other module's by get_buffer."""
    holders = model._holder_of if isinstance(model, GraphModel) else None
    if holders is None:
        return {n: model.get_buffer(n) for n in names}
    return {n: owner._buffers[attr] for n in names for owner, attr in [holders[n]]}


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


def sharing(compiled: Compiled, *, device: str | torch.device, dtype: torch.dtype,
            shared: dict[str, nn.Parameter]) -> GraphModel:
    """GraphModel(compiled) on `device` whose parameters named in `shared` are those very tensors (a frozen base a
    worker holds once for its training sessions: engine/frozen.py), made on meta and the others zero-filled on
    `device`: no memory is taken for the shared ones (a zero-filled copy of GPT-2's base is 472 MiB)."""
    model = GraphModel(compiled, device="meta", dtype=dtype)
    for target, (owner, attr) in model._holder_of.items():
        if target in shared:
            owner._parameters[attr] = shared[target]
        elif attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(torch.zeros_like(owner._parameters[attr], device=device))
        else:
            owner._buffers[attr] = torch.zeros_like(owner._buffers[attr], device=device)
    return model
