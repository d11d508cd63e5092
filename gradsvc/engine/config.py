"""EngineConfig: the engine's limits and the numerical check's budget, made from the process's Settings
(passed in: the engine reads no environment); and EngineCaches, every cache of the engine, sized by it.

EngineCaches: each a gradsvc LRU, owned by the Engine the API or a worker creates (never module state: a test
or a bench builds its own). Each is shared by every thread of its process (the API validates requests from a
thread pool); the work that fills a miss runs outside the LRU's lock, and two threads missing the same key at
once both compute it (the second write wins).

    meta_models      (layers, dtype, limits) -> the spec's model on meta and what the checks read of it
    output_shapes    (layers, dtype, input shape, input dtype) -> the output's shape and dtype on meta
    initial_states   (layers, dtype, seed) -> the seeded default state_dict, by bytes (config.init_cache_bytes)
    resident_models  (layers or graph_ref, dtype, device, scope) -> a model a finished compute handed back, with what
                     its weights were loaded from (resident.py), checked out by the next request of the model and
                     scope (the job's owner); by bytes (config.resident_model_bytes)
    staging          "pinned" -> the pinned host buffer weights go through to a GPU (resident.Staging), made on first use
    graph_templates  (graph_ref, dtype) -> the validated graph (GraphTemplate)
    graph_shapes     (graph_ref, dtype, input signature, math attention) -> the first output's shape, dtype, grad
    batch_flows      (graph_ref, dtype, input signature) -> the nodes mixing the batch, where it sits in the output
    estimates        everything POST /estimate's meta forward reads -> its Estimate
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from gradsvc.lru import LRU
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
    resident_model_bytes: int = 1 << 30  # models a worker keeps on its device with their weights (resident.py); 0: none
    max_krylov_bytes: int = 4 << 30  # options.curvature's Lanczos basis (diagnostics/lanczos.py: krylov_bytes)


def config_from_settings(settings, device: torch.device | None = None) -> EngineConfig:
    """The engine's limits from the process's Settings (passed in; the engine reads no environment). `device`: the
    worker's, whose memory sizes the resident models when GRADSVC_RESIDENT_MODEL_BYTES is -1 (its default)."""
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
        resident_model_bytes=settings.resident_model_bytes if settings.resident_model_bytes >= 0 else
        default_resident_bytes(device or torch.device("cpu"), settings.workers),
        max_krylov_bytes=settings.max_krylov_bytes,
    )


# The share of a GPU's memory its worker keeps models in by default: the rest holds a job's activations, its
# gradients (the model's bytes again), a session's optimizer state (twice more for Adam) and the allocator's cache.
RESIDENT_DEVICE_SHARE = 0.25
# The share of a CPU host's memory its workers keep models in together: the API, Redis and the jobs themselves
# (GRADSVC_MAX_JOB_BYTES, half the host by default) share the rest.
RESIDENT_HOST_SHARE = 0.125


def default_resident_bytes(device: torch.device, workers: int = 1) -> int:
    """GRADSVC_RESIDENT_MODEL_BYTES's default for a worker on `device`: a share of the GPU's memory, or of the host's
    memory split among the host's `workers` (1 GiB where the host does not say)."""
    if device.type == "cuda":
        return int(RESIDENT_DEVICE_SHARE * torch.cuda.get_device_properties(device).total_memory)
    try:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        host = 0
    return int(RESIDENT_HOST_SHARE * host) // max(1, workers) if host else 1 << 30


META_MODELS = 256
SHAPES = 512  # per input shape: output_shapes, graph_shapes, batch_flows
GRAPH_TEMPLATES = 64
ESTIMATES = 512


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class EngineCaches:
    meta_models: LRU
    output_shapes: LRU
    initial_states: LRU
    resident_models: LRU
    graph_templates: LRU
    graph_shapes: LRU
    batch_flows: LRU
    estimates: LRU
    staging: LRU  # "pinned" -> resident.Staging, made by the first copy to a GPU

    @classmethod
    def for_config(cls, config: EngineConfig) -> EngineCaches:
        return cls(meta_models=LRU(META_MODELS), output_shapes=LRU(SHAPES),
                   initial_states=LRU(max_bytes=config.init_cache_bytes, size=state_bytes),
                   resident_models=LRU(max_bytes=config.resident_model_bytes, size=lambda r: r.bytes),
                   graph_templates=LRU(GRAPH_TEMPLATES), graph_shapes=LRU(SHAPES),
                   batch_flows=LRU(SHAPES), estimates=LRU(ESTIMATES), staging=LRU(1))
