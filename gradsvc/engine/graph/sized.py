"""Ops whose output's shape depends on values (`nonzero`, `masked_select`, a boolean-mask `index`) in a graph
specialised to one batch: the node carries the size its output had at capture (OpNode.shape). The shape check
on the meta device, where such an op cannot run, takes that size; a real run checks its output has it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..errors import SpecError
from .ops import Op, meta_result
from .program import bad_graph, where_node

# Ops whose output holds indices (int64) rather than the values of their first argument.
_INDEX_OUTPUT = frozenset({"aten.nonzero.default", "aten.argwhere.default", "torchvision.nms.default"})
# The ops whose output's size may depend on values: the only ones a node's `shape` may be given for.
SIZED_OPS = _INDEX_OUTPUT | {"aten.masked_select.default", "aten.index.Tensor", "aten.bincount.default"}
_MAX_DIMS = 16


def sized_op(node: Any, op: Op) -> Op:
    """`op` run as the node's recorded size says (module docstring); a tensor-returning op only."""
    shape = node.shape
    if op.name not in SIZED_OPS:
        raise bad_graph(f"{where_node(node)}: 'shape' is given only for an op whose output's size depends on values "
                        f"({', '.join(sorted(SIZED_OPS))}); leave it out here", node=node.name)
    if op.returns != "tensor" or len(shape) > _MAX_DIMS or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise bad_graph(f"{where_node(node)}: 'shape' is the size of a tensor output whose shape depends on values "
                        f"(at most {_MAX_DIMS} sizes >= 0); got {shape!r} on an op returning {op.returns}",
                        node=node.name)
    return dataclasses.replace(op, fn=_sized(op.fn, list(shape), op.name in _INDEX_OUTPUT, where_node(node),
                                             counts=op.name == "aten.bincount.default"))


def _value_dtype(first: torch.Tensor, args: tuple, kwargs: dict, counts: bool) -> torch.dtype:
    """The output's dtype: its first argument's (values picked from it: masked_select of integer labels keeps them
    integers), but bincount's counts (int64, or its weights' dtype)."""
    if counts:  # bincount(ids, weights)
        weights = args[1] if len(args) > 1 else kwargs.get("weights")
        return weights.dtype if isinstance(weights, torch.Tensor) else torch.long
    return first.dtype


def _sized(fn: Callable, shape: list[int], index_output: bool, where: str, counts: bool = False) -> Callable:
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and first.device.type == "meta":
            # Values picked from `first` carry its gradient; indices do not.
            return meta_result(shape, torch.long if index_output else _value_dtype(first, args, kwargs, counts), first)
        out = fn(*args, **kwargs)
        if list(out.shape) != shape:
            raise SpecError("shape_mismatch", f"model.graph: {where}: its output has shape {list(out.shape)} on "
                            f"this batch where the capture it was specialised to had {shape}; capture the model "
                            "again on this batch (the SDK does when its guards no longer hold)",
                            expected=shape, got=list(out.shape))
        return out

    return run
