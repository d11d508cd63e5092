"""estimate(request) -> Estimate: parameter count and per-layer saved bytes, predicted by a metered forward
on the meta device (no data touched), looked up in the Engine's caches by everything it depends on."""

from __future__ import annotations

import copy

import msgspec

from gradsvc.wire import Estimate, GradientRequest

from .config import EngineCaches, EngineConfig
from .diagnostics.lanczos import krylov_bytes
from .passes import chunks, forward, metered, trainable
from .prepare import prepare
from .prepared import GraphResolver, Prepared
from .spec import prepare_for_meta


def _estimate_key(request: GradientRequest, prep: Prepared) -> tuple:
    """Everything the meta forward of estimate() reads: the model's structure (the layers spec, or a graph's
    content-hash ref), dtypes and shapes of inputs and targets, the losses and every option. Not the tensor
    values nor the weights: nothing runs on meta."""
    model = prep.graph.ref if prep.graph is not None else msgspec.json.encode(request.model.layers)
    return (model, request.model.dtype, prep.inputs.signature,
            tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(prep.targets.items())),
            msgspec.json.encode((request.loss, request.losses, request.options)), frozenset(prep.frozen))


def estimate(request: GradientRequest, config: EngineConfig | None = None, *,
             graphs: GraphResolver | None = None, caches: EngineCaches | None = None) -> Estimate:
    """Parameter count and per-layer saved bytes, predicted on the meta device (no data touched). Every
    request is checked in full by prepare() (its data too); only the metered meta forward that follows
    (~4 ms for a small net: torch's Python decompositions) is looked up in `caches` (the Engine's)."""
    config = config or EngineConfig()
    caches = caches if caches is not None else EngineCaches.for_config(config)
    prep = prepare(request, config, "meta", shape_only=True, graphs=graphs, caches=caches)
    key = _estimate_key(request, prep)
    hit = caches.estimates.get(key)
    if hit is not None:
        return hit  # shared: callers encode it, never change it
    result = _estimate(prep)
    caches.estimates.put(key, result)
    return result


def _estimate(prep: Prepared) -> Estimate:
    prep.model = copy.deepcopy(prep.model)  # prepare()'s meta model is shared (caches.meta_models)
    prepare_for_meta(prep.model)
    trainable(prep)
    prep.inputs = prep.inputs.to("meta")
    prep.targets = {k: v.to("meta") for k, v in prep.targets.items()}
    chunk = next(chunks(prep))
    with metered(prep.model, on=True) as meter:
        forward(prep, chunk, meter)
    return Estimate(parameter_count=prep.parameter_count, memory=meter.report(None), krylov_bytes=_krylov_bytes(prep))


def _krylov_bytes(prep: Prepared) -> int:
    """What options.curvature's Lanczos basis holds (the bound the meta check applied: decode.validate_krylov)."""
    c = prep.options.curvature
    if c is None:
        return 0
    size = sum(p.numel() for n, p in prep.model.named_parameters() if n not in prep.frozen)
    return krylov_bytes(c, size)
