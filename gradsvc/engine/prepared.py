"""What prepare() hands the later stages: the validated, ready-to-run pieces of a request (Prepared), the model's
inputs as one value (Batch), a graph validated once for a dtype (GraphTemplate), and how the batch splits into
micro-batches.

Batch: the tensors `forward` takes (in order), which of them carry the batch along dim 0, and the row slices
that micro-batches, shards and per-example gradients take of them. A layer spec takes one batched tensor. A
graph model takes what its `forward` takes: token ids and an attention mask (both batched), a graph's node
features (batched) and its `edge_index` (not batched: it has no row per example and goes whole to every
slice), two views of one batch, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
from torch import nn

from gradsvc.wire import GraphSpec, Options

from .graph.sparse import on_meta
from .losses import LossTerm

# graph_ref -> the stored graph (or None): the API's and the workers' Redis-backed store. The engine
# itself keeps no store, only the validated graphs its Engine has seen (GraphTemplate, below).
GraphResolver = Callable[[str], "GraphSpec | None"]


@dataclass(frozen=True)
class Batch:
    tensors: tuple[torch.Tensor, ...]
    batched: tuple[bool, ...]  # dim 0 of that tensor is the batch
    names: tuple[str, ...]

    @staticmethod
    def of(x: torch.Tensor, name: str = "inputs") -> "Batch":
        return Batch((x,), (True,), (name,))

    @property
    def first(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def rows(self) -> int:
        """The batch size: dim 0 of the batched inputs (prepare checked that they agree); 1 with none."""
        for x, b in zip(self.tensors, self.batched):
            if b:
                return int(x.shape[0])
        return 1

    @property
    def signature(self) -> tuple:
        """What shape checks and caches depend on: each input's shape and dtype, and which are batched."""
        return tuple((tuple(x.shape), x.dtype, b) for x, b in zip(self.tensors, self.batched))

    def numel(self) -> int:
        return sum(x.numel() for x in self.tensors)

    def rows_slice(self, a: int, b: int) -> "Batch":
        """Rows a:b of every batched input; the others whole."""
        return self.map(lambda x, batched: x[a:b] if batched else x)

    def map(self, fn: Callable[[torch.Tensor, bool], torch.Tensor]) -> "Batch":
        return Batch(tuple(fn(x, b) for x, b in zip(self.tensors, self.batched)), self.batched, self.names)

    def to(self, device: str | torch.device) -> "Batch":
        if str(device) == "meta":  # a sparse input's meta stand-in is dense: meta kernels take no sparse tensor
            return self.map(lambda x, _: on_meta(x))
        return self.map(lambda x, _: x.to(device))

    def floating(self) -> list[int]:
        """Positions of the floating inputs (those that have a gradient)."""
        return [i for i, x in enumerate(self.tensors) if x.dtype.is_floating_point]


@dataclass
class Prepared:
    model: nn.Sequential
    dtype: torch.dtype
    inputs: Batch
    targets: dict[str, torch.Tensor]  # loss term name -> target
    terms: list[LossTerm]
    output_shape: list[int]
    parameter_count: int
    options: Options
    frozen: set[str]
    graph: "GraphTemplate | None" = None  # graph models: the validated graph (its ref, state, input dtype)
    graph_data: bytes | None = None  # model.graph's canonical bytes (what the API stores under its ref)
    resident: tuple | None = None  # (key, resident.Resident) when `model` may go back to the resident models
    prepared: str | None = None  # on a device: "resident" (held from an earlier request) or "built"
    copied_bytes: int = 0  # the bytes copied into the model's tensors on its device
    # Output (and target) rows per batch row, where the output's rows map to the batch's in order (1 for a
    # classifier, seq for every-position LM logits flattened to (batch*seq, vocab)); None where they do
    # not: then nothing may split the batch (prepare refused micro_batch, per_sample and shards).
    rows_per_example: int | None = 1
    # graph models: batch_flow's (mixing nodes, where the batch sits in the first output), once computed
    batch_flow: tuple | None = None

    @property
    def gradient_bytes(self) -> int:
        """What the gradients alone take in the result (one per parameter, in the model's dtype)."""
        return self.parameter_count * self.dtype.itemsize


@dataclass(frozen=True)
class GraphTemplate:
    """A graph validated once for a dtype: its meta GraphModel (shared: copied before anything mutates
    it), the state it reads, and the nodes that mix the examples of a batch."""

    ref: str
    spec: GraphSpec
    model: nn.Module
    compiled: object  # graph.Compiled: immutable; fresh GraphModels are built from it, not deep-copied
    state: dict[str, torch.Tensor]  # state_dict name -> meta tensor (shape and dtype to expect)
    parameters: frozenset[str]
    users: tuple  # the graph's user inputs (wire.GraphInput), in forward's order
    index_bounds: dict[str, int]  # user input name -> rows of the smallest embedding table its ids index
    # The output the model's own loss differentiates (outputs.py), moved to the front of `spec.outputs`.
    first_output: int = 0

    @property
    def key(self) -> tuple:
        """What the caches of this graph's runs (shapes, batch flow, resident models) are keyed by."""
        return (self.ref, self.first_output)

    # What every prepare of the graph asks, worked out once (the template never changes).
    @cached_property
    def parameter_names(self) -> list[str]:
        return [n for n in self.state if n in self.parameters]

    @cached_property
    def parameter_count(self) -> int:
        return sum(self.state[n].numel() for n in self.parameter_names)

    @cached_property
    def sizes(self) -> dict[str, int]:
        """state_dict name -> bytes."""
        return {n: t.numel() * t.element_size() for n, t in self.state.items()}



def batch_chunks(n: int, micro_batch: int | None) -> list[tuple[int, int]]:
    size = n if not micro_batch else min(micro_batch, n)
    return [(i, min(i + size, n)) for i in range(0, n, size)] if n else [(0, 0)]

