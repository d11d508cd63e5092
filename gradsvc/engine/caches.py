"""EngineCaches: every cache of the engine, each a gradsvc LRU, owned by the Engine the API or a worker creates
(never module state: a test or a bench builds its own). Each is shared by every thread of its process (the API
validates requests from a thread pool); the work that fills a miss runs outside the LRU's lock, and two threads
missing the same key at once both compute it (the second write wins).

    meta_models      (layers, dtype, limits) -> the spec's model on meta and what the checks read of it
    output_shapes    (layers, dtype, input shape, input dtype) -> the output's shape and dtype on meta
    initial_states   (layers, dtype, seed) -> the seeded default state_dict, by bytes (config.init_cache_bytes)
    built_models     (layers, dtype, device) -> a CPU model a finished compute handed back, checked out by the next
    resident_models  (graph_ref, dtype, device) -> a CPU graph model with what its weights were loaded from
                     (resident.py), checked out by the next request of the graph; by bytes
                     (config.resident_model_bytes)
    graph_templates  (graph_ref, dtype) -> the validated graph (GraphTemplate)
    graph_shapes     (graph_ref, dtype, input signature, math attention) -> the first output's shape, dtype, grad
    batch_flows      (graph_ref, dtype, input signature) -> the nodes mixing the batch, where it sits in the output
    estimates        everything POST /estimate's meta forward reads -> its Estimate
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsvc.lru import LRU

from .config import EngineConfig

META_MODELS = 256
SHAPES = 512  # per input shape: output_shapes, graph_shapes, batch_flows
BUILT_MODELS = 16
GRAPH_TEMPLATES = 64
ESTIMATES = 512


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class EngineCaches:
    meta_models: LRU
    output_shapes: LRU
    initial_states: LRU
    built_models: LRU
    resident_models: LRU
    graph_templates: LRU
    graph_shapes: LRU
    batch_flows: LRU
    estimates: LRU

    @classmethod
    def for_config(cls, config: EngineConfig) -> "EngineCaches":
        return cls(meta_models=LRU(META_MODELS), output_shapes=LRU(SHAPES),
                   initial_states=LRU(max_bytes=config.init_cache_bytes, size=state_bytes),
                   built_models=LRU(BUILT_MODELS),
                   resident_models=LRU(max_bytes=config.resident_model_bytes, size=lambda r: r.bytes),
                   graph_templates=LRU(GRAPH_TEMPLATES), graph_shapes=LRU(SHAPES),
                   batch_flows=LRU(SHAPES), estimates=LRU(ESTIMATES))
