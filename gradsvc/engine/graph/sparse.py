"""Sparse graph inputs, buffers and parameters (a GCN's adjacency for `torch.spmm(adj, x)`, edge weights learned on
a fixed pattern): the wire's COO (indices, values) and CSR
(crow_indices, col_indices, values) parts decoded and checked into a torch sparse tensor, and the dense meta
stand-in the shape checks run on (meta kernels do not take sparse tensors)."""

from __future__ import annotations

from types import MappingProxyType

import torch

from gradsvc.wire import Tensor

from .. import tensors
from ..errors import SpecError

_PARTS = MappingProxyType({"sparse_coo": ("indices", "values"),
                           "sparse_csr": ("crow_indices", "col_indices", "values")})


def is_sparse_value(value) -> bool:
    return isinstance(value, Tensor) and value.layout is not None


def decode(value: Tensor, want: str | None, where: str, max_elements: int) -> torch.Tensor:
    """The sparse tensor `value` describes, its parts checked (dtypes, shapes, index bounds); `want` is the
    layout the graph's input declares (None: dense, which a sparse value does not fit)."""
    layout = value.layout
    if layout not in _PARTS:
        raise SpecError("bad_tensor", f"{where}: layout {layout!r} is not one of {sorted(_PARTS)}", where=where)
    if want != layout:
        takes = f"a {want} tensor" if want else "a dense tensor"
        raise SpecError("bad_tensor", f"{where}: the graph takes {takes} here (as captured), got {layout}; send it "
                        f"as the module was called with it", where=where, layout=layout)
    parts = {}
    for name in _PARTS[layout]:
        part = getattr(value, name)
        if part is None:
            raise SpecError("bad_tensor", f"{where}: a {layout} tensor needs {', '.join(_PARTS[layout])}; "
                            f"{name} is missing", where=f"{where}.{name}")
        parts[name] = tensors.decode(part, where=f"{where}.{name}", max_elements=max_elements)
    values = parts.pop("values")
    if values.dim() != 1 or str(values.dtype).removeprefix("torch.") != value.dtype:
        raise SpecError("bad_tensor", f"{where}.values: expected a 1-d {value.dtype} tensor, got "
                        f"{str(values.dtype).removeprefix('torch.')} of shape {list(values.shape)}", where=where)
    if values.is_floating_point() and not tensors.all_finite(values):
        raise SpecError("bad_tensor", f"{where}.values holds NaN or infinite values", where=where)
    for name, part in parts.items():
        if part.dtype not in (torch.int64, torch.int32):
            raise SpecError("bad_tensor", f"{where}.{name}: indices are int64 (or int32), got "
                            f"{str(part.dtype).removeprefix('torch.')}", where=f"{where}.{name}")
    return _built(layout, parts, values, list(value.shape), where)


def _built(layout: str, parts: dict, values: torch.Tensor, shape: list[int], where: str) -> torch.Tensor:
    try:
        if layout == "sparse_coo":
            return torch.sparse_coo_tensor(parts["indices"].to(torch.int64), values, shape, check_invariants=True)
        return torch.sparse_csr_tensor(parts["crow_indices"], parts["col_indices"], values, shape,
                                       check_invariants=True)
    except (RuntimeError, ValueError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise SpecError("bad_tensor", f"{where}: not a valid {layout} tensor of shape {shape}: {first}",
                        where=where, layout=layout) from None


def on_meta(x: torch.Tensor) -> torch.Tensor:
    """`x` on the meta device for the shape checks: a sparse tensor as a dense one of its shape and dtype."""
    if x.layout != torch.strided:
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x.to("meta")


def load_state(load, holders: dict, state_dict: dict, strict: bool, assign: bool):
    """`load` (nn.Module.load_state_dict) of `state_dict`, except that a sparse buffer (a GCN's adjacency) or
    parameter is set as it is: copy_ cannot write a sparse tensor into the dense placeholder the shape check ran
    with (a parameter stays a leaf that requires grad, as it was)."""
    held = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.layout != torch.strided}
    if not held:
        return load(state_dict, strict, assign)
    for name, value in held.items():
        owner, attr = holders[name]
        old = owner._parameters.get(attr)
        if old is not None:
            owner._parameters[attr] = torch.nn.Parameter(value.detach().to(old.device), old.requires_grad)
        else:
            owner._buffers[attr] = value.to(owner._buffers[attr].device)
    out = load({k: v for k, v in state_dict.items() if k not in held}, False, assign)
    missing = [k for k in out.missing_keys if k not in held]
    if strict and (missing or out.unexpected_keys):
        raise RuntimeError(f"load_state_dict: missing {missing}, unexpected {out.unexpected_keys}")
    return out
