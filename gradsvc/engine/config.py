"""EngineConfig: the engine's limits and the numerical check's budget, made from the process's Settings
(passed in: the engine reads no environment)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradsvc.wire import MAX_TIMING_REPEAT

from .spec import Limits


@dataclass(frozen=True)
class EngineConfig:
    limits: Limits = field(default_factory=Limits)
    numcheck_exact_max: int = 20_000
    numcheck_samples: int = 8
    numcheck_directions: int = 16
    numcheck_budget: float = 10.0  # auto: evaluations within this many times the job's forward+backward ...
    numcheck_budget_min_s: float = 0.25  # ... plus this
    max_timing_repeat: int = MAX_TIMING_REPEAT
    init_cache_bytes: int = 1 << 30
    resident_model_bytes: int = 1 << 30  # graph models a CPU worker keeps with their weights (resident.py); 0: none



def config_from_settings(settings) -> EngineConfig:
    """The engine's limits from the process's Settings (passed in; the engine reads no environment)."""
    return EngineConfig(
        limits=Limits(max_parameters=settings.max_parameters, max_layers=settings.max_layers,
                      max_depth=settings.max_depth, max_elements=settings.max_elements,
                      max_graph_nodes=settings.max_graph_nodes,
                      max_graph_intermediate_bytes=settings.max_job_bytes),
        numcheck_exact_max=settings.numcheck_exact_max,
        numcheck_samples=settings.numcheck_samples,
        numcheck_directions=settings.numcheck_directions,
        numcheck_budget=settings.numcheck_budget,
        numcheck_budget_min_s=settings.numcheck_budget_min_s,
        resident_model_bytes=settings.resident_model_bytes,
    )

