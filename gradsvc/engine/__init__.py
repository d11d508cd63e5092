"""Pure PyTorch: spec -> nn.Module, losses, gradients, numerical check, memory accounting. No Redis, no HTTP,
no environment reads. Usable as a library with no server running: `Engine(config).compute(request)`, or the
one-off `compute(request)` (caches of its own, dropped after the call).

A request goes through these stages, one module each, top to bottom:

    decode    tensors.py (wire tensors <-> torch), decode.py (losses, targets, options, weights: the validation
              layer specs and graphs share)
    build     layer specs: spec.py (gradsvc/layers.py -> nn.Sequential, shapes on meta), losses.py;
              graphs: graph/ (compiler.py: GraphSpec -> program.py's steps; ops.py the allow-list, functions.py
              the custom autograd Functions; interpreter.py's GraphModel runs them; meta_check.py shapes and
              sizes on meta; batch_flow.py which nodes mix a batch; sparse.py sparse inputs)
    prepare   prepare.py (one path, its model side LayerSpecModel in prepare_layers.py or GraphSpecModel in
              prepare_graph.py) -> prepared.py's Prepared (and Batch: the model's inputs and their rows)
    run       compute.py (the job: preprocess, inference, postprocess) -> passes.py (forward and backward,
              micro-batches, checkpointing; a non-finite loss or a failed node named), quantities.py (H v,
              per-sample gradients, and their checks), memory.py (saved bytes per layer), devices.py (device,
              RNG, out of memory), diagnostics/ (gradient statistics, clipping, curvature)
    check     check.py (the float64 reference, auto's plan) -> numcheck.py (finite differences, exact and
              directional, and the returned-gradient check)
    encode    compute.py (the GradientResult), estimate.py (POST /estimate on meta), reduce.py (shard results
              -> one result)

Engine (engine.py) holds an EngineConfig and the EngineCaches its calls share (config.py); errors.py is the
exception tree (EngineError: SpecError, ComputeError).
"""

from .compute import compute
from .config import EngineConfig, config_from_settings
from .devices import resolve_device
from .engine import Engine
from .errors import ComputeError, EngineError, SpecError
from .estimate import estimate
from .prepare import prepare
from .spec import Limits, layer_catalogue, warm_up_shape_check

__all__ = ["Engine", "compute", "estimate", "resolve_device", "EngineError", "SpecError", "ComputeError",
           "EngineConfig", "prepare", "config_from_settings", "Limits", "layer_catalogue", "warm_up_shape_check"]
