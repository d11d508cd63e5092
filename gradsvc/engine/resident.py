"""Graph models a CPU worker keeps between requests of one graph (EngineCaches.resident_models), each with what its
weights were loaded from, so that a weight a request names by the same reference as before (a frozen backbone, a
sweep or several probes over one checkpoint) is found in place: neither decoded, checked nor copied again.

A parameter is in place when the request names it by the same refs (its dtype, shape and the sha256 of each piece)
as the bytes loaded into it, and the model's tensor is the one loaded, unchanged since: its version counter, which
every in-place write through autograd's view of it bumps (the HVP check's perturbation), is what it was after the
load; a graph never writes a parameter (graph/compiler.py refuses it). Buffers are always copied in: a training forward
writes running statistics, and a kernel that updates them as a side effect (batch norm's) bumps no counter.

On a worker, refs name what a tensor's data holds: BlobStore.resolved fills the data of every tensor with refs
from its owner's own pieces, whatever the body said, and a piece's ref is the sha256 of its bytes, checked at
upload; so equal refs mean equal bytes, whichever owner sent them. A weight sent inline, or by other
refs, or changed in the model, is decoded, checked and copied in. A model is checked out by prepare (popped from
the pool) and handed back after a successful compute (release), so two computes never share one; a failed
compute's model is dropped. CUDA models are not kept (the same reason as prepare_layers.release_model: they would
hold device memory across jobs and show in the next job's allocator peak).
"""

from __future__ import annotations

import torch
from torch import nn

from gradsvc.wire import Tensor

from .config import EngineCaches, EngineConfig, state_bytes


def keeps(device: str | torch.device, config: EngineConfig) -> bool:
    """Whether a model on `device` goes to the resident pool (CPU, and a pool of some bytes)."""
    return torch.device(device).type == "cpu" and config.resident_model_bytes > 0


def identity(wire: Tensor) -> tuple | None:
    """What a wire weight's bytes are known by: (dtype, shape, refs) for one by reference, None when inline."""
    refs = wire.refs if isinstance(wire, Tensor) else None
    return (wire.dtype, tuple(wire.shape), tuple(refs)) if refs else None


class Resident:
    """A model and, per parameter name, (identity, tensor, version) of the weight loaded into it."""

    def __init__(self, model: nn.Module, parameters: frozenset[str]) -> None:
        self.model, self.parameters = model, parameters
        self.loaded: dict[str, tuple] = {}
        self.bytes = state_bytes(model.state_dict())

    def stale(self, given: dict) -> list[str]:
        """The names of `given` (state_dict name -> wire weight) whose weight is not in place: every buffer, and
        each parameter sent inline, by other refs than those loaded, or changed in the model since."""
        state = self.model.state_dict(keep_vars=True)
        out = []
        for name, wire in given.items():
            known, tensor = identity(wire), state[name]
            was = self.loaded.get(name)
            if known is None or was is None or was[0] != known or was[1] is not tensor or was[2] != tensor._version:
                out.append(name)
        return out

    def load(self, weights: dict[str, torch.Tensor], given: dict) -> None:
        """Copies the decoded, checked `weights` in and remembers each one's identity (from `given`)."""
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in weights.items():
                tensor = state[name]
                self.loaded.pop(name, None)  # not in place until the copy is done
                if value.layout != torch.strided or tensor.layout != torch.strided:
                    self.model.load_state_dict({**state, name: value})  # a sparse buffer: set, not copied
                    continue
                tensor.copy_(value)
                known = identity(given[name])
                if known is not None and name in self.parameters:
                    self.loaded[name] = (known, tensor, tensor._version)


def release(resident: Resident, key: tuple, caches: EngineCaches) -> None:
    """Hands a worker's graph model back for the next request of its graph (after compute() succeeded)."""
    caches.resident_models.put(key, resident)
