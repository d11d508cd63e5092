"""Custom `torch.autograd.Function`s inside an exported module keep their backward.

`torch.export` inlines a Function's forward and drops its backward, so the service would return autograd
of the forward (a straight-through estimator's `round` has a zero gradient). Here, while the module is
exported, each call of a user Function becomes one call of an op of its own (`gradsvc_fn::callN`); then
the Function's forward and backward are each exported as a graph of their own (wire.FunctionSpec), and
the service runs the user's backward. A Function whose backward cannot be captured is refused before
anything is sent (UnsupportedModuleError naming it and why).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradsvc import wire

from .errors import UnsupportedModuleError
from .graph import convert_program, reason

_LIB = torch.library.Library("gradsvc_fn", "FRAGMENT")  # a Library cannot drop an op: names are never reused
_numbers = itertools.count()
_STATIC_TYPES = (int, float, bool, str, type(None))


@dataclass
class _Call:
    """One Function applied with one set of non-tensor arguments: its op and an example of its inputs."""

    cls: type
    statics: tuple  # (position, value) of each non-tensor argument
    n_args: int
    key: str
    examples: list = field(default_factory=list)  # (shape, dtype) per tensor argument
    tuple_out: bool = True


class _Ctx:
    """What a Function's forward and backward use of `ctx`, outside autograd."""

    def __init__(self, n_args: int) -> None:
        self.saved_tensors: tuple = ()
        self.needs_input_grad = (True,) * n_args
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tuple(tensors)

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def mark_dirty(self, *tensors: Any) -> None:
        raise UnsupportedModuleError("a custom autograd Function modifies its input in place (ctx.mark_dirty); "
                                     "the service runs graphs that do not: return a new tensor instead")


def _forward(cls: type, ctx: _Ctx, args: list) -> Any:
    if getattr(cls, "setup_context", None) is not torch.autograd.function._SingleLevelFunction.setup_context:
        out = cls.forward(*args)  # the forward / setup_context style
        cls.setup_context(ctx, tuple(args), out)
        return out
    return cls.forward(ctx, *args)


def _full(call: _Call, xs: list) -> list:
    args: list = [None] * call.n_args
    statics = dict(call.statics)
    it = iter(xs)
    for i in range(call.n_args):
        args[i] = statics[i] if i in statics else next(it)
    return args


def _outputs(out: Any, name: str) -> list[torch.Tensor]:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise UnsupportedModuleError(f"custom autograd Function {name} returns something other than tensors; "
                                     "the service captures Functions whose forward returns tensors")
    return outs


class Capture:
    """The user Functions called while a module is exported (`with capture.active(): torch.export...`)."""

    def __init__(self) -> None:
        self.calls: dict[tuple, _Call] = {}

    @contextlib.contextmanager
    def active(self):
        function = torch.autograd.function.Function
        original = function.__dict__["apply"]

        def apply(cls, *args, **kwargs):
            if cls.__module__.startswith("torch") or kwargs:
                return original.__get__(None, cls)(*args, **kwargs)
            return self._call(cls, args)

        function.apply = classmethod(apply)
        try:
            yield self
        finally:
            function.apply = original

    def _call(self, cls: type, args: tuple) -> Any:
        name = cls.__qualname__
        statics = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                continue
            if not isinstance(a, _STATIC_TYPES):
                raise UnsupportedModuleError(f"custom autograd Function {name} takes argument {i} of type "
                                             f"{type(a).__name__}; the service captures Functions whose arguments "
                                             "are tensors and numbers, strings, booleans or None")
            statics.append((i, a))
        xs = [a for a in args if isinstance(a, torch.Tensor)]
        if not xs:
            raise UnsupportedModuleError(f"custom autograd Function {name} takes no tensor")
        key = (cls, tuple((i, type(v).__name__, repr(v)) for i, v in statics), len(args))
        call = self.calls.get(key)
        if call is None:
            call = _Call(cls, tuple(statics), len(args), f"call{next(_numbers)}")
            call.examples = [(_hint_shape(x), x.dtype) for x in xs]
            _define(call)
            self.calls[key] = call
        outs = getattr(torch.ops.gradsvc_fn, call.key)(xs)
        return tuple(outs) if call.tuple_out else outs[0]

    def functions(self) -> dict[str, wire.FunctionSpec]:
        """Each captured Function's forward and backward as graphs (exported now, on example inputs)."""
        return {call.key: _capture(call) for call in self.calls.values()}


def _hint_shape(x: torch.Tensor) -> list[int]:
    """A concrete shape for a traced (fake, maybe symbolic) tensor, without adding a guard on it."""
    out = []
    for d in x.shape:
        if isinstance(d, torch.SymInt):
            hint = d.node.hint
            out.append(int(hint) if hint is not None else 2)
        else:
            out.append(int(d))
    return out


def _define(call: _Call) -> None:
    def impl(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        out = _forward(call.cls, _Ctx(call.n_args), _full(call, list(xs)))
        call.tuple_out = isinstance(out, (tuple, list))
        return [o.clone() for o in _outputs(out, call.cls.__qualname__)]  # an op's outputs never alias its inputs

    _LIB.define(f"{call.key}(Tensor[] xs) -> Tensor[]")
    _LIB.impl(call.key, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"gradsvc_fn::{call.key}", impl, lib=_LIB)


class _ForwardOf(nn.Module):
    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.call = call

    def forward(self, *xs: torch.Tensor):
        return tuple(_outputs(_forward(self.call.cls, _Ctx(self.call.n_args), _full(self.call, list(xs))),
                              self.call.cls.__qualname__))


class _BackwardOf(nn.Module):
    """The forward (for what it saves) then the backward: (tensor inputs..., output grads...) -> the
    gradients of the tensor inputs that have one."""

    def __init__(self, call: _Call, n_out: int, keep: list[bool]) -> None:
        super().__init__()
        self.call, self.n_out, self.keep = call, n_out, keep

    def forward(self, *xs_and_gs: torch.Tensor):
        n_in = len(xs_and_gs) - self.n_out
        xs, gs = list(xs_and_gs[:n_in]), xs_and_gs[n_in:]
        ctx = _Ctx(self.call.n_args)
        _forward(self.call.cls, ctx, _full(self.call, xs))
        grads = _tensor_grads(self.call, self.call.cls.backward(ctx, *gs))
        return tuple(g for g, k in zip(grads, self.keep) if k)


def _tensor_grads(call: _Call, grads: Any) -> list:
    grads = list(grads) if isinstance(grads, (tuple, list)) else [grads]
    statics = dict(call.statics)
    return [g for i, g in enumerate(grads[:call.n_args]) if i not in statics]


def _capture(call: _Call) -> wire.FunctionSpec:
    name = call.cls.__qualname__
    xs = [torch.randn(shape, dtype=dt) if dt.is_floating_point else torch.zeros(shape, dtype=dt)
          for shape, dt in call.examples]
    with torch.no_grad():
        outs = list(_ForwardOf(call)(*xs))
    if not all(o.is_floating_point() for o in outs):
        raise UnsupportedModuleError(f"custom autograd Function {name} returns a non-floating tensor; the service "
                                     "captures Functions whose outputs all have a gradient")
    gs = [torch.randn_like(o) for o in outs]
    with torch.no_grad():
        grads = _tensor_grads(call, call.cls.backward(_saved_ctx(call, xs), *gs))
    if len(grads) != len(xs) or not all(g is None or isinstance(g, torch.Tensor) for g in grads):
        raise UnsupportedModuleError(f"custom autograd Function {name}: backward returns {len(grads)} gradients for "
                                     f"{len(xs)} tensor inputs; return one per input of forward (None for none)")
    keep = [g is not None and x.is_floating_point() for g, x in zip(grads, xs)]
    forward = _export(_ForwardOf(call), xs, name, "forward")
    backward = _export(_BackwardOf(call, len(outs), keep), [*xs, *gs], name, "backward")
    return wire.FunctionSpec(name=name, forward=convert_program(forward, _ForwardOf(call), [False] * len(xs))[0],
                             backward=convert_program(backward, _BackwardOf(call, len(outs), keep),
                                                      [False] * (len(xs) + len(gs)))[0], grads=keep)


def _saved_ctx(call: _Call, xs: list) -> _Ctx:
    ctx = _Ctx(call.n_args)
    _forward(call.cls, ctx, _full(call, xs))
    return ctx


def _export(module: nn.Module, xs: list, name: str, part: str) -> Any:
    auto = torch.export.Dim.AUTO
    try:
        return torch.export.export(module, tuple(xs), dynamic_shapes=tuple({i: auto for i in range(x.dim())}
                                                                          for x in xs))
    except Exception:
        try:
            return torch.export.export(module, tuple(xs))
        except Exception as exc:
            raise UnsupportedModuleError(f"custom autograd Function {name}: its {part} cannot be captured as a graph "
                                         f"({reason(exc)}); the service would not run it, so nothing was sent") from None
