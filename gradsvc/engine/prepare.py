"""Request -> validated, ready-to-run pieces (model, inputs, targets, loss terms), on meta or a device.

The API runs this on the meta device to reject a bad request before it is queued; the worker runs
it on its device. Both run the same validation, so a request that passes here does not fail later for
a reason that could have been known. One path for both kinds of model, in the order below: what
differs (the inputs a model takes, its output on meta, the splits it refuses, its weights) is the
model side's, LayerSpecModel (prepare_layers.py) or GraphSpecModel (prepare_graph.py); the rest is
decode.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsvc.wire import GradientRequest

from . import resident, tensors
from .config import EngineCaches, EngineConfig
from .decode import (decode_targets, loss_terms, refuse_own_loss_split, rows_per_example, validate_diagnostics,
                     validate_hvp, validate_options, validate_reductions)
from .errors import SpecError
from .prepare_graph import GraphSpecModel
from .prepare_layers import LayerSpecModel
from .prepared import Batch, GraphResolver, Prepared


def prepare(request: GradientRequest, config: EngineConfig, device: str | torch.device = "meta", *,
            shape_only: bool = False, graphs: GraphResolver | None = None,
            caches: EngineCaches | None = None, scope: str | None = None) -> Prepared:
    """Validates and builds everything; on "meta" nothing runs. `shape_only` (POST /estimate) accepts
    inputs and targets given as dtype and shape alone. `graphs` resolves `model.graph_ref`. `caches`
    are the calling Engine's (None: a one-off call, with caches of its own). `scope`: whose resident models this
    request may check out (a worker passes the job's owner: resident.py)."""
    checked = _checked(request, config, shape_only, graphs, caches)
    model, held = checked.side.model(device, shape_only, scope)  # the weights decoded and checked (those not in place)
    return checked.prepared(model, held, device)


def prepare_held(request: GradientRequest, config: EngineConfig, device: torch.device, model: torch.nn.Module, *,
                 graphs: GraphResolver | None = None, caches: EngineCaches | None = None,
                 held: "Held | None" = None) -> Prepared:
    """prepare() around a model the caller keeps on `device` (a training session's, engine/session.py): the same
    checks of the batch, the model run as it is (the request's weights neither read nor needed), going back to
    no pool; `held`: how the session runs the batch (Held)."""
    held = held or Held()
    return _checked(request, config, False, graphs, caches, (held.loss, held.parts)).prepared(model, None, device)


@dataclass(frozen=True)
class Held:
    """How a training session runs a batch: `loss=False`, with no loss terms and no targets (a forward of a batch
    sent without targets); `parts`, split in that many parts of rows (a session over several workers:
    engine/replicas.py), so its targets' rows must follow the batch's."""

    loss: bool = True
    parts: int = 1


@dataclass
class _Checked:
    """What prepare() validated before it builds the model: the model's side and the batch's pieces."""

    side: LayerSpecModel | GraphSpecModel
    dtype: torch.dtype
    inputs: Batch
    out: torch.Tensor
    terms: list
    targets: dict[str, torch.Tensor]
    rows: int | None
    frozen: set[str]
    opts: object

    def prepared(self, model: torch.nn.Module, held: tuple | None, device: str | torch.device) -> Prepared:
        side, inputs, targets = self.side, self.inputs, self.targets
        if str(device) != "meta":
            inputs = inputs.to(device)
            targets = {k: v.to(device) for k, v in targets.items()}
        graph = side.template if isinstance(side, GraphSpecModel) else None
        return Prepared(model=model, dtype=self.dtype, inputs=inputs, targets=targets, terms=self.terms,
                        output_shape=list(self.out.shape), parameter_count=side.parameter_count, options=self.opts,
                        frozen=self.frozen, graph=graph, graph_data=side.graph_data if graph is not None else None,
                        resident=held, prepared=side.prepared, copied_bytes=side.copied_bytes,
                        rows_per_example=self.rows, batch_flow=side.flow if graph is not None else None)


def _checked(request: GradientRequest, config: EngineConfig, shape_only: bool, graphs: GraphResolver | None,
             caches: EngineCaches | None, how: tuple[bool, int] = (True, 1)) -> _Checked:
    """Every check of the request in prepare()'s order, but the model's weights (side.model's)."""
    caches = caches if caches is not None else EngineCaches.for_config(config)
    opts, max_elements = request.options, config.limits.max_elements
    dtype = model_dtype(request)
    side = LayerSpecModel(request, config, caches, dtype) if request.model.layers is not None else \
        GraphSpecModel(request, config, caches, dtype, graphs)
    if opts.outputs and not isinstance(side, GraphSpecModel):
        raise SpecError("bad_option", "options.outputs returns a graph model's outputs; a layer spec has one output, "
                        "the one its loss reads: leave options.outputs out", option="outputs")
    inputs = side.inputs(shape_only)  # each decoded and checked; the batched ones agree on the batch size
    out = side.output(inputs)  # on meta: a layer or node that cannot take its input is named
    loss, parts = how
    terms = loss_terms(request) if loss else []
    targets = decode_targets(request, terms, out, dtype, max_elements, shape_only) if loss else {}
    refuse_own_loss_split(opts, terms, inputs.rows)
    validate_reductions(opts, terms)
    side.validate_splits(opts, inputs)
    split_by = "options.workers" if parts > 1 else None
    rows = rows_per_example(opts, inputs, out, side.output_batch(opts, inputs, split_by is not None), split_by)
    frozen = validate_options(opts, config, inputs.rows, side.top_layers, side.parameter_names)
    validate_hvp(opts, side.meta, frozen)
    validate_diagnostics(opts, terms, side.meta, frozen, config.max_krylov_bytes)
    side.validate_batch_statistics(opts, inputs)
    return _Checked(side, dtype, inputs, out, terms, targets, rows, frozen, opts)


def release(prep: Prepared, caches: EngineCaches) -> None:
    """Hands a worker's model back to its resident pool for the next request (after compute() succeeded)."""
    if prep.resident is not None:
        key, held = prep.resident
        prep.resident = None
        resident.release(held, key, caches)


def model_dtype(request: GradientRequest) -> torch.dtype:
    """model.dtype, a floating one; and exactly one of layers, graph or graph_ref."""
    dtype_name = request.model.dtype
    if dtype_name not in tensors.FLOAT_DTYPES:
        raise SpecError("bad_option", f"model.dtype {dtype_name!r} is not a floating-point dtype; use one of "
                        f"{', '.join(tensors.FLOAT_DTYPES)}")
    given = [k for k in ("layers", "graph", "graph_ref") if getattr(request.model, k) is not None]
    if len(given) != 1:
        raise SpecError("bad_option", f"model: give exactly one of 'layers', 'graph' or 'graph_ref', got "
                        f"{given or 'none'}", given=given)
    return tensors.TORCH_DTYPES[dtype_name]
