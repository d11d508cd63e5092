"""POST /gradients' body: the model, the batch, the loss and every option."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from gradsvc.wire.common import AtLeastOne, NonEmpty
from gradsvc.wire.graphs import GraphSpec
from gradsvc.wire.runs import RunRef
from gradsvc.wire.tensors import Tensor

MAX_TIMING_REPEAT = 50
# Each shard is an RQ job carrying the model's weights: a bound on what one request may fan out to.
MAX_SHARDS = 256


class ModelSpec(Struct, forbid_unknown_fields=True):
    """Exactly one of `layers` (a declarative stack), `graph` (an exported graph) or `graph_ref` (the
    content hash of a graph this service validated before, as returned in a result's `graph_ref`)."""

    layers: Annotated[list[dict[str, Any]], NonEmpty] | None = None
    graph: GraphSpec | None = None
    graph_ref: str | None = None
    dtype: str = "float32"
    seed: int = 0
    weights: dict[str, Tensor] | None = None


class LossSpec(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A built-in loss (`type`), or the model's own loss: `{"type": "output"}`, or `{"output": k}` naming the
    scalar among forward's outputs (k: a position in the tuple it returns, or a key of the dict or
    ModelOutput it returns)."""

    type: str | None = None
    reduction: str = "mean"
    name: str | None = None
    weight: float = 1.0
    target: str | None = None
    output: int | str | None = None


class HvpOptions(Struct, forbid_unknown_fields=True):
    vector: str | dict[str, Tensor] = "random"
    seed: int = 0


NumcheckMode = Literal["auto", "off", "exact", "sampled", "directional"]


class ClipOptions(Struct, forbid_unknown_fields=True):
    """Gradient clipping: global (as torch.nn.utils.clip_grad_norm_) or per example (Opacus's DP-SGD step,
    noise of standard deviation noise_multiplier x max_norm drawn from the job's seed)."""

    max_norm: Annotated[float, Meta(gt=0)]
    per_sample: bool = False
    noise_multiplier: Annotated[float, Meta(ge=0)] = 0.0


class CurvatureOptions(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Curvature of the loss from matrix-vector products of the Hessian or the GGN (J^T H_out J): the `top`
    eigenvalues by Lanczos, the Hutchinson trace over `probes` Rademacher vectors, and the stochastic Lanczos
    quadrature density (`probes` runs of `iterations` steps). Probe i is drawn from `seed` and its index alone,
    so `first_probe` picks where in the seed's sequence this request's probes start: requests with the same
    seed and disjoint ranges compute disjoint parts of one estimate (sharded jobs split their probes so)."""

    matrix: Literal["hessian", "ggn"] = "hessian"
    top: Annotated[int, Meta(ge=0)] = 1
    trace: bool = False
    density: bool = False
    probes: AtLeastOne | None = None
    iterations: AtLeastOne | None = None
    tolerance: Annotated[float, Meta(gt=0, lt=1)] = 1e-3
    seed: int = 0
    eigenvectors: bool = False
    first_probe: Annotated[int, Meta(ge=0)] = 0


class Options(Struct, forbid_unknown_fields=True, omit_defaults=True):
    numcheck: NumcheckMode = "auto"
    numcheck_eps: Annotated[float, Meta(gt=0, lt=1)] = 1e-6
    numcheck_samples: AtLeastOne | None = None
    numcheck_tolerance: Annotated[float, Meta(gt=0)] = 1e-6
    memory: bool = True
    timing_repeat: Annotated[int, Meta(ge=1, le=MAX_TIMING_REPEAT)] = 1
    micro_batch: AtLeastOne | None = None
    checkpoint_segments: AtLeastOne | None = None
    freeze: list[str] = []
    input_grad: bool = False
    hvp: HvpOptions | None = None
    per_loss: bool | None = None
    graph: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    per_sample: Literal["off", "norms", "full"] = "off"
    encoding: Literal["auto", "list", "b64"] = "auto"
    # Split the batch along its first dimension across this many RQ jobs (workers), reduced into one
    # result; "auto": one shard per live worker of the device, each of at least GRADSVC_MIN_SHARD_ROWS rows.
    shards: Annotated[int, Meta(ge=1, le=MAX_SHARDS)] | Literal["auto"] = 1
    # The dtype of the returned gradients (smaller answers: bfloat16 and float16 halve float32's); the
    # returned-gradient check judges them at that dtype's tolerance. Default: the model's dtype.
    gradient_dtype: Literal["float16", "bfloat16", "float32", "float64"] | None = None
    # false: the batch's gradient is neither computed nor returned (every gradient null), only what
    # per_sample asks for: a sweep of per-example norms over a dataset with fixed weights.
    batch_gradient: bool = True
    # Graph models: return forward's outputs (result.outputs, the structure forward returns).
    outputs: bool = False
    # Gradient diagnostics (DIAGNOSTICS), each an entry of result.diagnostics; clipping; curvature.
    diagnostics: list[Literal["norms", "variance", "second_moment", "noise_scale"]] = []
    clip: ClipOptions | None = None
    curvature: CurvatureOptions | None = None


# `inputs`: one tensor (a tensor object, or a bare nested list), a list of tensor objects (the positional
# arguments of a graph's forward) or an object of named tensors (its keyword arguments); checked by the engine.
Inputs = Annotated[Any, Meta(description=(
    "One tensor ({dtype, shape, data|b64} or a bare nested list), a list of tensor objects (a graph model's "
    "positional inputs, in forward's order) or an object of named tensor objects (by input name)"))]


class GradientRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    model: ModelSpec
    inputs: Inputs
    # Tensor | nested list | {name: Tensor | nested list} (several losses); checked by the engine.
    targets: Any = None
    loss: str | LossSpec | None = None
    losses: Annotated[list[LossSpec], NonEmpty] | None = None
    options: Options = msgspec.field(default_factory=Options)
    run: RunRef | None = None
