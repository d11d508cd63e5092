"""Request -> checked, ready-to-run pieces (model, inputs, targets, loss terms), on meta or a device.

The API runs this on the meta device to reject a bad request before it is queued; the worker runs
it on its device. Both see the same checks, so a request that passes here does not fail later for
a reason that could have been known. A layer spec goes through prepare_layers.py, a graph through
prepare_graph.py; both share decode.py's checks of everything but the model.
"""

from __future__ import annotations

import torch

from gradsvc.wire import GradientRequest

from . import tensors
from .caches import EngineCaches
from .config import EngineConfig
from .errors import SpecError
from .prepare_graph import prepare_graph
from .prepare_layers import prepare_layers
from .prepared import GraphResolver, Prepared


def prepare(request: GradientRequest, config: EngineConfig, device: str | torch.device = "meta", *,
            shape_only: bool = False, graphs: GraphResolver | None = None,
            caches: EngineCaches | None = None) -> Prepared:
    """Checks and builds everything; on "meta" nothing runs. `shape_only` (POST /estimate) accepts
    inputs and targets given as dtype and shape alone. `graphs` resolves `model.graph_ref`. `caches`
    are the calling Engine's (None: a one-off call, with caches of its own)."""
    caches = caches if caches is not None else EngineCaches.for_config(config)
    dtype_name = request.model.dtype
    if dtype_name not in tensors.FLOAT_DTYPES:
        raise SpecError("bad_option", f"model.dtype {dtype_name!r} is not a floating-point dtype; use one of "
                        f"{', '.join(tensors.FLOAT_DTYPES)}")
    dtype = tensors.TORCH_DTYPES[dtype_name]
    given = [k for k in ("layers", "graph", "graph_ref") if getattr(request.model, k) is not None]
    if len(given) != 1:
        raise SpecError("bad_option", f"model: give exactly one of 'layers', 'graph' or 'graph_ref', got "
                        f"{given or 'none'}", given=given)
    if request.model.layers is None:
        return prepare_graph(request, config, caches, device, dtype, shape_only=shape_only, graphs=graphs)
    return prepare_layers(request, config, caches, device, dtype, shape_only=shape_only)
