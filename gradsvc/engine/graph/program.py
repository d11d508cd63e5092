"""The compiled graph: what the compiler (compiler.py) emits and the interpreter (interpreter.py) runs.

Values a node's arguments may hold besides literals: `Ref` (an earlier slot), `FloatDType` (a floating dtype,
mapped to the run dtype), `DEVICE` (the model's device). A `Step` is one node, a `Compiled` the whole graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from .. import tensors
from ..errors import SpecError
from .ops import Op

DTYPES = MappingProxyType({**tensors.TORCH_DTYPES, "int8": torch.int8, "int16": torch.int16})  # dtype arguments


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
    written_inputs: frozenset = frozenset()  # user input and constant slots a node writes in place (each run a copy)

    def __deepcopy__(self, memo: dict) -> "Compiled":
        return self  # immutable


def bad_graph(message: str, code: str = "bad_option", **detail: Any) -> SpecError:
    return SpecError(code, f"model.graph: {message}", **detail)


def where_node(node: Any) -> str:
    module = f" in module {node.module!r} ({node.module_type})" if node.module else ""
    return f"node {node.name!r} ({node.op}){module}"


def where_step(step: Step) -> str:
    module = f" in module {step.module!r} ({step.module_type})" if step.module else ""
    return f"node {step.name!r} ({step.op.name}){module}"
