"""Engine: what a process creates once (the API at start-up, each worker in its context) and calls for every
request: its EngineConfig and the caches that config sizes. Tests and benches build their own."""

from __future__ import annotations

import torch

from gradsvc.wire import Estimate, GradientRequest, GradientResult

from . import resident
from .combine import combine
from .compute import Run, execute
from .devices import resolve_device
from .config import EngineCaches, EngineConfig
from .estimate import estimate
from .numcheck import ProgressCallback
from .prepare import prepare
from .prepared import GraphResolver, Prepared


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.caches = EngineCaches.for_config(self.config)

    def prepare(self, request: GradientRequest, device: str | torch.device = "meta", *, shape_only: bool = False,
                graphs: GraphResolver | None = None, scope: str | None = None) -> Prepared:
        return prepare(request, self.config, device, shape_only=shape_only, graphs=graphs, caches=self.caches,
                       scope=scope)

    def compute(self, request: GradientRequest, *, progress: ProgressCallback | None = None,
                device: torch.device | None = None, graphs: GraphResolver | None = None,
                reference: dict[str, torch.Tensor] | None = None, scope: str | None = None) -> GradientResult:
        run = Run(request, self.config, device or resolve_device(request.options.device), progress, reference)
        return execute(run, graphs, self.caches, scope)

    def combine(self, requests: list[tuple[GradientRequest, str | None, GraphResolver | None]],
                device: torch.device) -> list[GradientResult | None]:
        """Requests (each with its scope and graph resolver) that run as one batched computation where they can
        (combine.py): each one's result, or None for one left to compute alone."""
        return combine(requests, self.config, device, self.caches)

    def in_place(self, request: GradientRequest, device: torch.device, scope: str | None = None) -> set[str]:
        """The names of the request's weights (by reference) that a model held for `scope` on `device` has in place
        now: a worker leaves their bytes in Redis (compute then neither decodes nor copies them)."""
        return resident.in_place_weights(self.caches, request, device, scope)

    def estimate(self, request: GradientRequest, *, graphs: GraphResolver | None = None) -> Estimate:
        return estimate(request, self.config, graphs=graphs, caches=self.caches)
