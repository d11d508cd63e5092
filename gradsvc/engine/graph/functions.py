"""A graph's custom autograd Functions (wire.FunctionSpec): the user's forward and backward, each compiled
as a graph of allowed ops, run as one `torch.autograd.Function`, so that autograd (and the numerical check
against it) uses the user's backward, as local training does, not autograd of the forward."""

from __future__ import annotations

import torch

from gradsvc.wire import FunctionSpec

from .interpreter import GraphModel
from .ops import Op, Param
from .program import Compiled, bad_graph

MAX_FUNCTIONS = 64


class CompiledFunction:
    """One FunctionSpec, validated: its forward and backward graphs and which arguments get a gradient."""

    def __init__(self, name: str, forward: Compiled, backward: Compiled, grads: tuple[bool, ...]) -> None:
        self.name, self.forward, self.backward, self.grads = name, forward, backward, grads

    def __deepcopy__(self, memo: dict) -> "CompiledFunction":
        return self  # immutable, like Compiled

    def op(self, key: str) -> Op:
        def call(xs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return _Apply.apply(self, *xs)

        return Op(f"function.{key}", call, (Param("xs", ("list", ("tensor",)), False, False),), "tensors")


def compile_function(key: str, spec: FunctionSpec, compile_graph, limits) -> CompiledFunction:
    """Both graphs checked like the model's own (the allow-list, arguments, shapes on meta later), with no
    parameters and no Functions of their own."""
    for part, graph in (("forward", spec.forward), ("backward", spec.backward)):
        if graph.functions:
            raise bad_graph(f"functions[{key!r}].{part} calls Functions of its own; a Function's graphs call ATen ops only")
        kinds = {inp.kind for inp in graph.inputs}
        if not kinds <= {"input", "constant"}:
            raise bad_graph(f"functions[{key!r}].{part} has inputs of kind {sorted(kinds - {'input', 'constant'})}; a "
                       "Function's graphs take tensors and constants only", function=key)
    forward, backward = compile_graph(spec.forward, limits=limits), compile_graph(spec.backward, limits=limits)
    n_in = sum(1 for _, inp in forward.inputs if inp.kind == "input")
    n_out = len(forward.outputs)
    n_bwd_in = sum(1 for _, inp in backward.inputs if inp.kind == "input")
    if len(spec.grads) != n_in or n_bwd_in != n_in + n_out or len(backward.outputs) != sum(spec.grads):
        raise bad_graph(f"functions[{key!r}] ({spec.name[:100]}): forward takes {n_in} tensors and returns {n_out}; "
                   f"backward must take {n_in + n_out} (got {n_bwd_in}), 'grads' must have {n_in} entries (got "
                   f"{len(spec.grads)}) and backward return one gradient per true entry (got "
                   f"{len(backward.outputs)})", function=key)
    return CompiledFunction(spec.name[:200], forward, backward, tuple(spec.grads))


def _run(compiled: Compiled, xs: tuple) -> list:
    like = next((x for x in xs if x.is_floating_point()), xs[0])
    dtype = like.dtype if like.is_floating_point() else compiled.dtype
    model = GraphModel(compiled, device=like.device, dtype=dtype)
    model.upcast_all = dtype == torch.float64  # the numerical check's float64 copy: the Function in float64 too
    return model.run(*xs)


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: CompiledFunction, *xs: torch.Tensor):
        ctx.fn = fn
        ctx.save_for_backward(*xs)
        return tuple(_run(fn.forward, xs))

    @staticmethod
    def backward(ctx, *gs: torch.Tensor):
        xs = ctx.saved_tensors
        grads = iter(_run(ctx.fn.backward, (*xs, *gs)))
        out = [next(grads) if keep else None for keep in ctx.fn.grads]
        for i, (x, g) in enumerate(zip(xs, out)):
            if g is not None and not _fits(x, g):
                raise bad_graph(f"the custom Function {ctx.fn.name!r}: its backward returned a gradient of shape "
                                f"{list(g.shape)} for its argument {i}, of shape {list(x.shape)}; backward must return "
                                "each gradient in its argument's shape (or one that sums to it, as autograd allows)",
                                code="shape_mismatch", function=ctx.fn.name, argument=i, expected=list(x.shape),
                                got=list(g.shape))
        return (None, *out)


def _fits(x: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether autograd takes g as x's gradient: x's shape, or one x broadcasts to (autograd sums it down)."""
    if g.shape == x.shape:
        return True
    try:
        return torch.broadcast_shapes(x.shape, g.shape) == g.shape
    except RuntimeError:
        return False
