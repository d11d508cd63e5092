"""Engine: what a process creates once (the API at start-up, each worker in its context) and calls for every
request: its EngineConfig and the caches that config sizes. Tests and benches build their own."""

from __future__ import annotations

import torch

from gradsvc.wire import Estimate, GradientRequest, GradientResult

from .compute import compute
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
                graphs: GraphResolver | None = None) -> Prepared:
        return prepare(request, self.config, device, shape_only=shape_only, graphs=graphs, caches=self.caches)

    def compute(self, request: GradientRequest, *, progress: ProgressCallback | None = None,
                device: torch.device | None = None, graphs: GraphResolver | None = None,
                reference: dict[str, torch.Tensor] | None = None) -> GradientResult:
        return compute(request, self.config, progress=progress, device=device, graphs=graphs, reference=reference,
                       caches=self.caches)

    def estimate(self, request: GradientRequest, *, graphs: GraphResolver | None = None) -> Estimate:
        return estimate(request, self.config, graphs=graphs, caches=self.caches)
