"""Per-layer activation memory: bytes autograd saves for backward while each layer runs.

Each storage counts once (the first layer to save it owns it) and parameters are excluded, as in the
backprop memory measurement (2.0 MiB per 1024-wide layer at batch 512 in float32). A graph model (GraphModel) has one row per module path its nodes ran in: its
submodules only hold tensors and are never called, so the running node's path says who saves. Storages are told apart by their StorageImpl (`_cdata`), not `data_ptr()`,
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
    if t.layout == torch.sparse_coo:  # a sparse input saved for backward (torch.spmm): its values' storage
        return t._values().untyped_storage()._cdata
    if t.layout == torch.sparse_csr:
        return t.values().untyped_storage()._cdata
    return t.untyped_storage()._cdata


_OUTSIDE = "\0outside"  # saved after a graph's forward (the loss): counted once, shown in no row


class ActivationMeter:
    """Installs module hooks and saved-tensor hooks; `report()` gives the per-layer table."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # A GraphModel names the module path of each node it runs (graph/interpreter.py); anything else has its modules.
        self.graph = model if hasattr(model, "node_modules") and hasattr(model, "track_modules") else None
        self.names = {m: name for name, m in model.named_modules() if name} if self.graph is None else {}
        self.paths = {} if self.graph is None else _paths(self.graph.node_modules)
        self.inside = False
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
        if self.graph is not None:
            owner = self.graph.current_module if self.inside else _OUTSIDE
        else:
            owner = self.stack[-1] if self.stack else ""
        self.keep(t, owner)
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
        if self.graph is not None:
            with self._recording_graph():
                yield self
            return
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

    @contextlib.contextmanager
    def _recording_graph(self) -> Iterator["ActivationMeter"]:
        graph = self.graph

        def forward(*inputs: torch.Tensor) -> torch.Tensor:  # run() with a visit for each node's output size
            self.inside = True
            try:
                return graph.run(*inputs, visit=self._visit)[0]
            finally:
                self.inside = False

        graph.track_modules = True
        graph.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            graph.track_modules = False
            del graph.forward

    def _visit(self, i: int, out, args, kwargs) -> None:
        # The last node of a module path gives that module's output; of several outputs (a GRU's output and
        # h_n), the first, and a getitem picking one of them again is no new output.
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            out = out[0]
        elif self.graph._graph.steps[i].op.name == "operator.getitem":
            return
        if isinstance(out, torch.Tensor):
            self._record_output(self.graph.node_modules[i][1], out)

    def _leave(self, name: str, out) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        if isinstance(out, torch.Tensor):
            self._record_output(name, out)

    def _record_output(self, name: str, out: torch.Tensor) -> None:
        self.output[name] = out.numel() * out.element_size()
        self.output_shape[name] = list(out.shape)

    def report(self, device_peak_bytes: int | None = None) -> Memory:
        if self.graph is not None:
            return self._report_graph(device_peak_bytes)
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

    def _report_graph(self, device_peak_bytes: int | None) -> Memory:
        owned: dict[str, int] = {}
        for name, p in self.model.named_parameters():
            path = name.rpartition(".")[0]
            owned[path] = owned.get(path, 0) + p.numel() * p.element_size()
        layers = [LayerMemory(name=path, type=kind, saved_bytes=self.saved.get(path, 0),
                              output_bytes=self.output.get(path, 0), parameter_bytes=owned.get(path, 0),
                              output_shape=self.output_shape.get(path))
                  for path, kind in self.paths.items()]
        return Memory(layers=layers, saved_bytes_total=sum(entry.saved_bytes for entry in layers),
                      device_peak_bytes=device_peak_bytes)


def _paths(node_modules: list[tuple[str, str, str]]) -> dict[str, str]:
    """Module path -> class name, in the order the graph first runs a node in each ("" is the root)."""
    paths: dict[str, str] = {}
    for _, path, kind in node_modules:
        if kind or path not in paths:  # the first node that names its module's class decides
            paths[path] = paths.get(path) or kind
    return {path: kind or ("root" if not path else "") for path, kind in paths.items()}
