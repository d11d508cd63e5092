"""The model's inputs as one value: the tensors `forward` takes (in order), which of them carry the batch
along dim 0, and the row slices that micro-batches, shards and per-example gradients take of them.

A layer spec takes one batched tensor. A graph model takes what its `forward` takes: token ids and an
attention mask (both batched), a graph's node features (batched) and its `edge_index` (not batched: it
has no row per example and goes whole to every slice), two views of one batch, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .graph.sparse import on_meta


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
