"""The op allow-list for graph models: which ATen overloads a graph may call, how each one's arguments
are checked (its own torch schema) and what runs in its place (zero-filled `empty*`, no-op asserts).

Every entry is a name as `torch.export` prints it ("aten.linear.default") or one of the few Python
operators export emits on sizes ("operator.mul"). Nothing here touches the host: no op with a file
name, a pointer or a storage, no printing, and no op returning uninitialised memory (the `empty*`
family runs as its `zeros*` twin). In-place ops run on intermediates, or on buffers (running
statistics) under no_grad; on a parameter or an input they are refused.

A graph means what its program says on any device and kernel: `view`, `_unsafe_view` and `view_as` run as
`reshape` (a view wherever the input's layout allows one), because the layout a kernel returned at
capture (which made a `.contiguous()` a no-op there) is not the worker's. Random ops draw from the
job's seed (devices.seeded), as dropout does. Every op of PyTorch's core ATen opset that has a
derivative formula is allowed except REFUSED_CORE (docs/graph-ops.md says why for each).
"""

from __future__ import annotations

import operator
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import torch

from . import library_ops

aten = torch.ops.aten

# Argument types, as small tuples: ("tensor",) ("int",) ("float",) ("bool",) ("number",) ("str",)
# ("dtype",) ("layout",) ("memory_format",) ("device",) ("optional", T) ("list", T) ("any",).
ArgType = tuple


@dataclass(frozen=True)
class Param:
    name: str
    type: ArgType
    kwarg_only: bool
    has_default: bool
    is_write: bool = False  # the op writes this argument in place (Tensor(a!))
    default: Any = None


@dataclass(frozen=True)
class Op:
    """One allowed op: `fn` runs it, `params` check its arguments, `returns` is what a node holds
    ("tensor", "tensors", "scalar" or "none"), `aliases_input` whether the result is a view of (or the
    same tensor as) its first argument."""

    name: str
    fn: Callable
    params: tuple[Param, ...]
    returns: str
    aliases_input: bool = False
    inplace: bool = False  # writes its first argument
    is_assert: bool = False  # a metadata check: skipped (dtypes change from the graph's when run in float64)
    along_dim: bool = False  # combines values along its `dim`/`dims` argument (the batch-mixing check)
    reshapes: bool = False  # reinterprets the row-major order (view/reshape/flatten)
    recurrent: bool = False  # runs each row of its batch dim on its own, combining time steps (gru, lstm, rnn)
    n_outputs: int | None = None  # a multi-output op's fixed count (None: a list of any length)
    random: bool = False  # draws random numbers (besides dropout's masks): replayed from the job's seed


_SPECIAL = re.compile(r"(ScalarType|Layout|MemoryFormat)\??(?:\[\])? (\w+)")


def _arg_type(t: Any, special: str | None) -> ArgType:
    kind = t.kind()
    if kind == "OptionalType":
        return ("optional", _arg_type(t.getElementType(), special))
    if kind == "ListType":
        return ("list", _arg_type(t.getElementType(), special))
    if special is not None and kind == "IntType":
        return ({"ScalarType": "dtype", "Layout": "layout", "MemoryFormat": "memory_format"}[special],)
    simple = {"TensorType": "tensor", "IntType": "int", "SymIntType": "int", "FloatType": "float",
              "BoolType": "bool", "SymBoolType": "bool", "NumberType": "number", "StringType": "str",
              "DeviceObjType": "device", "GeneratorType": "generator"}  # a generator: only None (the job's seed)
    if kind not in simple:
        raise TypeError(f"argument type {t} is not allowed in a graph")
    return (simple[kind],)


def _returns(schema: Any) -> str:
    rets = schema.returns
    if not rets:
        return "none"
    if len(rets) > 1 or rets[0].type.kind() == "ListType":
        return "tensors"
    return "tensor" if rets[0].type.kind() in ("TensorType", "OptionalType") else "scalar"


# Arguments an op may write besides its first: batch norm's running statistics (the compiler checks that
# they are buffers).
_STAT_ARGS = frozenset({"running_mean", "running_var"})


def _from_schema(name: str, overload: Any, fn: Callable | None = None, **flags: Any) -> Op:
    schema = overload._schema
    special = {arg: kind for kind, arg in _SPECIAL.findall(str(schema))}
    params = tuple(Param(a.name, _arg_type(a.type, special.get(a.name)), a.kwarg_only, a.has_default_value(),
                         bool(a.alias_info is not None and a.alias_info.is_write),
                         a.default_value if a.has_default_value() else None) for a in schema.arguments)
    aliases = bool(schema.returns and schema.returns[0].alias_info is not None)
    inplace = bool(params and params[0].is_write)
    if any(p.is_write and p.name not in _STAT_ARGS for p in params[1:]):
        raise TypeError(f"{name} writes an argument other than its first")
    n_outputs = len(schema.returns) if len(schema.returns) > 1 else None
    return Op(name, fn or overload, params, _returns(schema), aliases_input=aliases, inplace=inplace,
              n_outputs=n_outputs, **flags)


# ---- The table ----------------------------------------------------------------------------------
# allowed_ops.toml beside this file: the names by group ("name.overload" under torch.ops.aten), and which of them
# combine values along `dim`/`dims` (the batch-mixing check looks at that argument).
with (Path(__file__).parent / "allowed_ops.toml").open("rb") as _f:
    _TABLE = tomllib.load(_f)
_GROUPS = MappingProxyType({name: frozenset(names.split()) for name, names in _TABLE["groups"].items()})
_ALONG_DIM = frozenset(_TABLE["along_dim"]["ops"].split())

# Core ATen ops with a derivative formula that a graph may not call, and why (docs/graph-ops.md says the same).
REFUSED_CORE = MappingProxyType({
    "as_strided.default": "reads the input's memory through the strides it had at capture, which another "
                          "device's or kernel's layout does not reproduce; export emits it for no public module, "
                          "and a program that calls x.as_strided is rewritten with view/reshape/unfold",
})


# Ops the capture can emit that a graph may not call, and why (docs/graph-ops.md says the same): the core
# refusals, then the rest. tests/support/emitted_ops.py counts every op op_db and module_db programs emit.
_SPARSE_MADE = ("makes or reduces a sparse tensor inside the graph, whose number of stored values depends on the "
                "values, so the shape and memory checks before the queue cannot bound it; sparse tensors may be "
                "inputs, buffers and parameters (they travel as their indices and values), and torch.sparse.mm / "
                "torch.spmm on them run")
REFUSED = MappingProxyType({
    **{f"aten.{k}": v for k, v in REFUSED_CORE.items()},
    "aten.as_strided_copy.default": REFUSED_CORE["as_strided.default"],
    "aten.rrelu_with_noise.default": "writes its `noise` argument, a tensor of its own, besides its result; the "
                                     "allow-list checks writes to the first argument and to running statistics "
                                     "only. F.rrelu in training mode calls it: use leaky_relu, or rrelu in eval mode",
    "aten._to_sparse.default": _SPARSE_MADE,
    "aten._sparse_mm_reduce_impl.default": _SPARSE_MADE,
    "aten.sparse_sampled_addmm.default": _SPARSE_MADE,
})


def _zeros_like_empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return torch.zeros(size, dtype=dtype, layout=layout, device=device)


def _zeros_empty_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return torch.zeros_like(self, dtype=dtype, layout=layout, device=device)


def _zeros_new_empty(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return self.new_zeros(size, dtype=dtype, layout=layout, device=device)


def _zeros_empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return torch.zeros(size, dtype=dtype, layout=layout, device=device)


# The `empty*` family returns whatever the allocator hands back (on a shared GPU, another caller's
# tensors); here each runs as its zero-filled twin, checked against the original's schema.
_ZERO_FILLED = MappingProxyType({
    "empty.memory_format": _zeros_like_empty,
    "empty_like.default": _zeros_empty_like,
    "new_empty.default": _zeros_new_empty,
    "empty_strided.default": _zeros_empty_strided,
    "new_empty_strided.default": lambda self, size, stride, **kw: _zeros_new_empty(self, size, **kw),
})


def _reshape(self: torch.Tensor, size: list) -> torch.Tensor:
    return torch.reshape(self, size)  # a view wherever the input's layout allows one, a copy elsewhere


def _reshape_as(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.reshape(self, other.shape)


def meta_result(shape, dtype: torch.dtype, *inputs: torch.Tensor) -> torch.Tensor:
    """An op's result on the meta device made from its sizes alone: a floating one carries a gradient when an input
    does, as the op's own would (the shape check's no_gradient test follows requires_grad)."""
    out = torch.empty(shape, dtype=dtype, device="meta")
    grad = next((t for t in inputs if t.requires_grad), None)
    return out + grad.sum() * 0 if grad is not None and (dtype.is_floating_point or dtype.is_complex) else out


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch._grouped_mm (every Mixture-of-Experts layer of transformers 5) as the matmuls it stands for, one per
    group: the same values in every dtype and on every device, where the kernel has no float64 (the check's) and,
    on a CPU, no backward. 2-D x 3-D: the rows of `mat_a` up to offs[g] times expert g's matrix (rows past the last
    offset zero); 3-D x 3-D: a batched matmul; 2-D x 2-D: `offs` splits the shared dimension, one (m, n) per group;
    3-D x 2-D: `offs` splits mat_b's columns."""
    if mat_a.dim() == 3 and mat_b.dim() == 3:
        out = torch.bmm(mat_a, mat_b)
    elif mat_a.device.type == "meta":  # the shape check: the sizes alone (offs has no values there)
        groups = offs.shape[0] if offs is not None else 1
        shape = {(2, 3): (mat_a.shape[0], mat_b.shape[-1]), (2, 2): (groups, mat_a.shape[0], mat_b.shape[1]),
                 (3, 2): (mat_a.shape[1], mat_b.shape[1])}[(mat_a.dim(), mat_b.dim())]
        out = meta_result(shape, torch.promote_types(mat_a.dtype, mat_b.dtype), mat_a, mat_b)
    else:
        ends = offs.tolist()
        spans = list(zip([0, *ends[:-1]], ends))
        if mat_a.dim() == 2 and mat_b.dim() == 3:  # (rows, k) x (groups, k, n)
            parts = [mat_a[s:e] @ mat_b[g] for g, (s, e) in enumerate(spans)]
            rest = mat_a.shape[0] - (ends[-1] if ends else 0)
            out = torch.cat([*parts, mat_a.new_zeros(rest, mat_b.shape[-1])]) if rest else torch.cat(parts)
            if bias is not None:
                out = out + torch.cat([bias[g].expand(e - s, -1) for g, (s, e) in enumerate(spans)]
                                      + [bias.new_zeros(rest, bias.shape[-1])])
                bias = None
        elif mat_a.dim() == 2:  # (m, k) x (k, n), k split into groups
            out = torch.stack([mat_a[:, s:e] @ mat_b[s:e] for s, e in spans])
        else:  # (groups, m, k) x (k, n), n split into groups
            out = torch.cat([mat_a[g] @ mat_b[:, s:e] for g, (s, e) in enumerate(spans)], dim=1)
    if bias is not None:
        out = out + bias.unsqueeze(-2) if out.dim() == 3 else out + bias
    return out if out_dtype is None else out.to(out_dtype)


def _ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
              target_lengths: torch.Tensor, blank: int = 0, zero_infinity: bool = False) -> Any:
    """aten._ctc_loss, which has no meta kernel: on meta its outputs' sizes, (batch,) and the alpha table
    (batch, T, 2 S + 1), S the targets' length (a 1-D concatenation's whole length: the longest one's follows values;
    only backward reads the table); elsewhere the op itself."""
    if log_probs.device.type != "meta":
        return aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
    longest = targets.shape[-1] if targets.dim() == 2 else targets.shape[0]
    return (meta_result((batch,) if log_probs.dim() == 3 else (), log_probs.dtype, log_probs),
            meta_result((batch, log_probs.shape[0], 2 * longest + 1), log_probs.dtype, log_probs))


# Ops that run as a Python equivalent (same schema, same values): the kernel lacks a dtype, a device or a meta kernel.
_RUN_AS = MappingProxyType({"_grouped_mm.default": _grouped_mm, "_ctc_loss.Tensor": _ctc_loss})


# Layout facts that held at capture only: these run as what they mean on any device.
_AS_RESHAPE = MappingProxyType({"view.default": _reshape, "_unsafe_view.default": _reshape,
                                "view_as.default": _reshape_as})


def drawn_in(op: Op, draw: torch.dtype) -> Callable:
    """`op` drawing its floating random numbers in `draw` (the dtype the graph was captured in) and cast to the
    dtype the run asks for. torch draws other numbers in float64 than in float32 from the same seed, so the
    numerical check's float64 copy would otherwise see other noise than the run it checks."""

    def run(*args: Any, **kwargs: Any) -> Any:
        asked = kwargs.get("dtype")
        if asked is not None:  # a factory (randn(size, dtype=...), randn_like(x, dtype=...))
            if not asked.is_floating_point or asked == draw:
                return op.fn(*args, **kwargs)
            return op.fn(*args, **{**kwargs, "dtype": draw}).to(asked)
        like = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if like is None or like.dtype == draw:
            return op.fn(*args, **kwargs)
        cast = [a.to(draw) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        out = op.fn(*cast, **kwargs)
        if op.inplace:  # bernoulli_, normal_, uniform_: the numbers land in the tensor the graph named
            return args[0].copy_(out)
        return out.to(like.dtype) if out.is_floating_point() else out

    return run


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


_INT_LIMIT = 2**62


def _checked(fn: Callable) -> Callable:
    """A Python operator on sizes, refusing results beyond int64 (chained squaring would otherwise
    build integers of gigabytes)."""

    def run(*args: Any) -> Any:
        out = fn(*args)
        if isinstance(out, int) and not -_INT_LIMIT < out < _INT_LIMIT:
            raise ValueError(f"integer result {str(out)[:20]}... is out of range")
        return out

    return run


def _python_op(name: str, fn: Callable, arity: int, returns: str = "scalar") -> Op:
    params = tuple(Param(f"arg{i}", ("number",), False, False) for i in range(arity))
    return Op(f"operator.{name}", _checked(fn), params, returns)


def _truediv(a: Any, b: Any) -> float:
    return a / b


PYTHON_OPS = MappingProxyType({
    op.name: op for op in [
        _python_op("add", operator.add, 2), _python_op("sub", operator.sub, 2), _python_op("mul", operator.mul, 2),
        _python_op("floordiv", operator.floordiv, 2), _python_op("truediv", _truediv, 2),
        _python_op("mod", operator.mod, 2), _python_op("neg", operator.neg, 1),
        _python_op("eq", operator.eq, 2), _python_op("ne", operator.ne, 2), _python_op("lt", operator.lt, 2),
        _python_op("le", operator.le, 2), _python_op("gt", operator.gt, 2), _python_op("ge", operator.ge, 2),
    ]
})
# getitem picks one tensor out of a multi-output op (split, max.dim, native_batch_norm, ...).
GETITEM = Op("operator.getitem", operator.getitem,
             (Param("seq", ("tensors",), False, False), Param("index", ("int",), False, False)), "tensor")


# Library ops (not ATen) the service runs itself, with torch's ops (library_ops.py).
LIBRARY_OPS = MappingProxyType({
    "torchvision.nms.default": Op("torchvision.nms.default", library_ops.nms,
                                  (Param("dets", ("tensor",), False, False), Param("scores", ("tensor",), False, False),
                                   Param("iou_threshold", ("float",), False, False)), "tensor"),
})


def _build_table() -> tuple[MappingProxyType, tuple[str, ...]]:
    """(the allowed ops by name, the entries this torch lacks or gives a schema the checks cannot read)."""
    table: dict[str, Op] = {"operator.getitem": GETITEM, **PYTHON_OPS}
    skipped = []
    reshapes, asserts = _GROUPS["views"], _GROUPS["asserts"]
    recurrent, draws = _GROUPS["recurrent"], _GROUPS["draws"]
    for entry in [e for names in _TABLE["groups"].values() for e in names.split()] + list(_ZERO_FILLED):
        base, overload = entry.rsplit(".", 1)
        packet = getattr(aten, base, None)
        ovl = getattr(packet, overload, None) if packet is not None else None
        name = f"aten.{entry}"
        try:
            if ovl is None:
                raise TypeError("not in this torch")
            fn = _no_op if entry in asserts else _AS_RESHAPE.get(entry) or _ZERO_FILLED.get(entry) or _RUN_AS.get(entry)
            table[name] = _from_schema(name, ovl, fn=fn, is_assert=entry in asserts, along_dim=entry in _ALONG_DIM,
                                       reshapes=entry in reshapes, recurrent=entry in recurrent, random=entry in draws)
        except TypeError as exc:  # a newer torch's schema (a Generator argument, ...): left out, not a crash
            skipped.append(f"{name}: {exc}")
    table.update(LIBRARY_OPS)
    return MappingProxyType(table), tuple(skipped)


OPS, SKIPPED = _build_table()  # SKIPPED: none on torch 2.13

ALLOWED_OPS_DOC = "docs/graph-ops.md (the list: gradsvc/engine/graph/allowed_ops.toml, and GET /schema)"


def op_catalogue() -> list[str]:
    """Every allowed op name, sorted (for GET /schema and the README)."""
    return sorted(OPS)
