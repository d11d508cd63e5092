"""What a recording (trace.py) does with an op beyond the ATen ops the service runs: a library's op recorded
through its Python implementation (its own, or one the library ships written with ATen ops), an `out=` variant as
its functional op, and an op with no gradient that reads and answers integers held as the constant it was."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten
# Ops whose output shape depends on the values of their inputs (the node records the size it had).
DATA_DEPENDENT = frozenset({"aten.nonzero.default", "aten.masked_select.default", "aten.argwhere.default",
                            "aten.bincount.default", "aten.where.default",  # where(cond): nonzero's indices
                            "torchvision.nms.default"})  # the boxes it keeps: run by the service (library_ops.py)


def op_name(func: torch._ops.OpOverload) -> str:
    return f"{func.namespace}.{func._schema.name.split('::', 1)[1]}.{func._overloadname}"


# Ops with no gradient whose result the graph holds as it was on this batch (a constant: trace._Recorder._specialise),
# when every tensor they read is integer or boolean (exact: the service, in float64 or on another device, would compute
# the same): the unique family (its output's size and values depend on values; no derivative), and a library's op
# without a Python implementation whose outputs are all integers or booleans. One that reads floating values
# (torchvision's nms, on scores) is not held: the service runs it (gradsvc/engine/graph/library_ops.py) or refuses it.
SPECIALISED = frozenset({"aten._unique2.default", "aten._unique.default", "aten.unique_dim.default",
                         "aten.unique_consecutive.default", "aten.unique_dim_consecutive.default"})
# A library's op that has no Python implementation of its own but one in the library, written with ATen ops (what
# the library runs where its C++ kernels are not built): recorded as that implementation. "namespace::op":
# (module, function); the function takes the op's arguments in its schema's order.
REFERENCE_IMPLEMENTATIONS = {"torchvision::roi_align": ("torchvision.ops.roi_align", "_roi_align")}


def recorded_through(func: Any, kwargs: dict) -> Any:
    """What runs in place of `func` so that the recording holds ATen ops the service allows: a library's own op with
    a Python implementation (torch.library.custom_op, such as transformers' grouped_mm_fallback) as that
    implementation, one without as the library's reference implementation (REFERENCE_IMPLEMENTATIONS); an `out=`
    variant (torch.mm(a, b, out=buf)) as its functional op and a copy_ into `out`. None: `func` is recorded as it
    is."""
    if not isinstance(func, torch._ops.OpOverload):
        return None
    if func.namespace not in ("aten", "prims"):
        from torch._library.custom_ops import OPDEFS

        qualified = f"{func.namespace}::{func._schema.name.split('::', 1)[1]}"
        implementation = getattr(OPDEFS.get(qualified), "_init_fn", None)
        if implementation is None and qualified in REFERENCE_IMPLEMENTATIONS:
            module, name = REFERENCE_IMPLEMENTATIONS[qualified]
            implementation = getattr(importlib.import_module(module), name, None)
        return implementation
    out = kwargs.get("out")
    if func.namespace == "aten" and writes_out(func._schema) and isinstance(out, torch.Tensor):
        packet = getattr(aten, func._schema.name.split("::", 1)[1], None)
        functional = getattr(packet, "default", None) if packet is not None else None
        if functional is not None and not writes_out(functional._schema):
            def run(*args: Any, **kw: Any) -> torch.Tensor:
                result = functional(*args, **{k: v for k, v in kw.items() if k != "out"})
                return kw["out"].copy_(result)
            return run
    return None


def specialised(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether `func`'s result is held as a constant (SPECIALISED): every tensor it reads integer or boolean, and it
    is a unique op or a library's op (recorded through to ATen where it could be, so here one without an
    implementation, and not one the service runs) whose tensor outputs are all integer or boolean."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace == "prims" or op_name(func) in DATA_DEPENDENT:
        return False
    read = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.is_floating_point() or t.is_complex() for t in read):
        return False
    if func.namespace == "aten":
        return op_name(func) in SPECIALISED
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(tensors) and not any(t.is_floating_point() or t.is_complex() for t in tensors)


def writes_out(schema: Any) -> bool:
    """An `out=` variant: a keyword-only `out` argument it writes."""
    return any(a.name == "out" and a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
               for a in schema.arguments)
