"""Per-layer activation memory: bytes autograd saves for backward while each layer runs.

Each storage counts once (the first layer to save it owns it) and parameters are excluded, as in
seed 003's table [C]. Storages are told apart by their StorageImpl (`_cdata`), not `data_ptr()`,
which is 0 for every tensor on the meta device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import nn

from gradsvc.wire import LayerMemory, Memory

from .spec import leaves


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class ActivationMeter:
    """Installs module hooks and saved-tensor hooks; `report()` gives the per-layer table."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {m: name for name, m in model.named_modules() if name}
        self.leaves = leaves(model)
        self.param_keys = {_storage_key(p) for p in model.parameters()}
        self.seen: set[int] = set()
        self.saved: dict[str, int] = {}
        self.output: dict[str, int] = {}
        self.output_shape: dict[str, list[int]] = {}
        self.stack: list[str] = []
        self.hook_s = 0.0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self.keep(t, self.stack[-1] if self.stack else "")
        self.hook_s += time.perf_counter() - start
        return t

    def keep(self, t: torch.Tensor, owner: str) -> None:
        """Counts `t` as held for backward by `owner`, unless it is a parameter or already counted."""
        key = _storage_key(t)
        if key not in self.param_keys and key not in self.seen:
            self.seen.add(key)
            # The view first saved sets the size: a micro-batch slice of the inputs is not the whole batch.
            self.saved[owner] = self.saved.get(owner, 0) + t.numel() * t.element_size()

    @contextlib.contextmanager
    def recording(self) -> Iterator["ActivationMeter"]:
        handles = []
        for module, name in self.names.items():
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self.stack.append(name)))
            handles.append(module.register_forward_hook(lambda m, a, out, name=name: self._leave(name, out)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()

    def _leave(self, name: str, out) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        if isinstance(out, torch.Tensor):
            self.output[name] = out.numel() * out.element_size()
            self.output_shape[name] = list(out.shape)

    def report(self, device_peak_bytes: int | None = None) -> Memory:
        layers = []
        for module, name in self.names.items():
            is_leaf = not list(module.children())
            saved = self.saved.get(name, 0)
            if not is_leaf and saved == 0:
                continue
            params = sum(p.numel() * p.element_size() for p in module.parameters(recurse=is_leaf))
            layers.append(LayerMemory(name=name, type=type(module).__name__, saved_bytes=saved,
                                      output_bytes=self.output.get(name, 0), parameter_bytes=params,
                                      output_shape=self.output_shape.get(name)))
        return Memory(layers=layers, saved_bytes_total=sum(entry.saved_bytes for entry in layers),
                      device_peak_bytes=device_peak_bytes)
