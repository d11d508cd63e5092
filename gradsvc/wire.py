"""The wire format: every request, result and error Struct, shared by the API, the workers and the SDK.

No torch here: the SDK imports this module without PyTorch installed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta, Struct

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "bool", "complex64", "complex128")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1, "bool": 1,
            "complex64": 8, "complex128": 16}
# Complex tensors: raw bytes (MessagePack `data`, JSON `b64`) interleave each element's real and imaginary
# parts (little-endian float32 for complex64, float64 for complex128); nested `data` lists hold each element
# as a [real, imaginary] pair (one more dimension of size 2 than `shape`).
COMPLEX_DTYPES = ("complex64", "complex128")
JOB_STATUSES = ("queued", "started", "finished", "failed", "canceled")
MAX_TIMING_REPEAT = 50
# Each shard is an RQ job carrying the model's weights: a bound on what one request may fan out to.
MAX_SHARDS = 256
# POST /gradients header: the ids of finished jobs whose results the client holds, for the service to drop
# now rather than keep GRADSVC_RESULT_TTL_S (docs/api.md); at most this many a request.
RELEASE_HEADER = "Gradsvc-Release-Results"
MAX_RELEASED = 16

# Constraints the API refuses at decode (400 invalid_body, with the path); the OpenAPI document declares them.
NonEmpty = Meta(min_length=1)
AtLeastOne = Annotated[int, Meta(ge=1)]


class Tensor(Struct, omit_defaults=True):
    """A tensor on the wire: nested `data` lists or raw little-endian C-order bytes (`data` in
    MessagePack, `b64` in JSON), or `refs`: the sha256 (64 hex digits) of each piece of those raw bytes,
    in order, as uploaded before by PUT /tensors/{sha256} (a tensor sent once, used by reference).

    Raw bytes decode as a memoryview into the message itself, not a copy (a 12.7 MB body: 13 ms -> 1 ms to
    decode): a decoded tensor keeps its whole message alive, so what outlives a request (a graph's constants
    kept with the graph) is copied out of it first (`owned`)."""

    dtype: str
    shape: list[int]
    data: list | memoryview | None = None  # bytes too, as given to the constructor
    b64: str | None = None
    refs: list[str] | None = None
    # A sparse tensor (a graph input only): `layout` "sparse_coo" with `indices` (int64, (len(shape), nnz)) and
    # `values` ((nnz,), of `dtype`), or "sparse_csr" with `crow_indices` ((rows + 1,)), `col_indices` ((nnz,))
    # and `values`; `shape` is the dense shape and the tensor itself carries no data.
    layout: str | None = None
    indices: Tensor | None = None
    values: Tensor | None = None
    crow_indices: Tensor | None = None
    col_indices: Tensor | None = None


def raw_data(t: Tensor) -> "bytes | bytearray | memoryview | None":
    """A tensor's raw bytes as it carries them in `data` (None when `data` is nested lists, or absent)."""
    return t.data if isinstance(t.data, (bytes, bytearray, memoryview)) else None


def owned(tensors: "dict[str, Tensor]") -> None:
    """Each tensor's raw bytes as bytes of their own, no longer a view into the message they came in."""
    for t in tensors.values():
        if isinstance(t.data, memoryview):
            t.data = bytes(t.data)


# A bare nested list (or a scalar) is accepted for inputs and targets.
TensorLike = Tensor | list | float


def is_tensor(value: Any) -> bool:
    """A tensor object: the Struct, or (inside a field typed Any: inputs, targets) the plain map of one."""
    return isinstance(value, Tensor) or (isinstance(value, dict) and {"dtype", "shape"} <= set(value))


class GraphInput(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One input of an exported graph (a placeholder of `torch.export`'s graph). `name` is what the
    nodes refer to; `target` is the state_dict name (parameter, buffer) or the `constants` key.
    `dtype` and `shape` are the captured tensor's: a parameter's or buffer's exactly (the graph model is
    built on the meta device from them, before any weight is decoded), a user input's as in the example
    it was exported with, -1 for a dynamic size ("int64" inputs are token ids or indices). The user inputs,
    in order, are `forward`'s arguments: a request's `inputs` gives them as a list in that order or as an
    object by `name`."""

    name: str
    kind: Literal["input", "parameter", "buffer", "constant"]
    target: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    # A user input's batch dimension: 0, or null for an input without one (a graph's edge_index, a mask
    # shared by every example), which goes whole to every micro-batch, shard and per-example gradient.
    batch_dim: Literal[0] | None = 0
    # A sparse user input: "sparse_coo" or "sparse_csr" (the request sends it in that layout); null: dense.
    layout: Literal["sparse_coo", "sparse_csr"] | None = None


class OpNode(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One call in an exported graph: `op` is an allow-listed ATen overload ("aten.linear.default") or
    one of the few Python operators export emits ("operator.getitem", "operator.mul", ...).

    Arguments are plain data: a JSON scalar (int, float, bool, null, string), a list of arguments,
    `{"node": name}` (an input's or an earlier node's value), `{"float": "inf"|"-inf"|"nan"}`,
    `{"dtype": "float32"}`, `{"device": "cpu"}`, `{"layout": "strided"}` or
    `{"memory_format": "contiguous_format"}`. `module` is the module path the call ran in (from
    `nn_module_stack`, "" for the root module) and `module_type` that module's class name."""

    name: str
    op: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    module: str = ""
    module_type: str = ""


class GraphSpec(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A model captured by `torch.export` as plain data (format version 1). `outputs` are the user
    outputs (arguments as in OpNode.args; the loss applies to the first); `buffer_mutations` maps a
    buffer's state_dict name to the node whose value the buffer takes after the forward pass (batch
    norm's running statistics); `dtype` is the floating dtype the graph was captured in."""

    inputs: list[GraphInput]
    nodes: list[OpNode]
    outputs: list[Any]
    dtype: str = "float32"
    constants: dict[str, Tensor] = {}
    buffer_mutations: dict[str, str] = {}
    version: int = 1
    # The structure forward returns, over `outputs`: an integer is outputs[i], a list a tuple or list, an
    # object a dict or ModelOutput (by key), null a None. Absent: the outputs as a flat tuple. It names the
    # outputs `loss: {"output": ...}` may pick and shapes `result.outputs`.
    output_tree: Any = None
    # Custom autograd Functions the nodes call (op "function.<key>"), by key.
    functions: dict[str, FunctionSpec] = {}


class FunctionSpec(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A custom `torch.autograd.Function` a graph calls: an OpNode with op "function.<key>" and args
    `[[{"node": x}, ...]]` (its tensor arguments) returns its outputs (picked by operator.getitem).
    `forward` maps the tensor arguments to the outputs; `backward` maps (the tensor arguments, then one
    gradient per output) to the gradients of the arguments `grads` marks true (the others get none).
    Both are graphs of allowed ops with inputs of kind "input" and "constant" only; `name` is the
    Function's class name, for messages."""

    name: str
    forward: GraphSpec
    backward: GraphSpec
    grads: list[bool]


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

# options.diagnostics names: what researchers compute from the gradients (docs/diagnostics.md).
DIAGNOSTICS = ("norms", "variance", "second_moment", "noise_scale")
# Of those, the ones made of per-example gradients (refused where the examples cannot be separated).
PER_EXAMPLE_DIAGNOSTICS = ("variance", "second_moment", "noise_scale")


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


# A run's name: shown on pages and in CSV (escaped there), a Prometheus label value and a path segment of
# /runs/{name}, hence no "/" and no control characters.
RUN_NAME_PATTERN = r"^[^/\x00-\x1f\x7f]+$"
RunName = Annotated[str, Meta(min_length=1, max_length=128, pattern=RUN_NAME_PATTERN)]
MAX_RUN_STEP = 10**12


class RunRef(Struct, forbid_unknown_fields=True):
    """`run` on POST /gradients: the training run this request is a step of (docs/runs.md). `step` null: the
    service numbers it, one after the run's last recorded step (0 for its first)."""

    name: RunName
    # At most 10^12: the record script (Lua, whose numbers are doubles) writes every step number exactly.
    step: Annotated[int, Meta(ge=0, le=MAX_RUN_STEP)] | None = None


class GradientRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    model: ModelSpec
    inputs: Inputs
    # Tensor | nested list | {name: Tensor | nested list} (several losses); checked by the engine.
    targets: Any = None
    loss: str | LossSpec | None = None
    losses: Annotated[list[LossSpec], NonEmpty] | None = None
    options: Options = msgspec.field(default_factory=Options)
    run: RunRef | None = None


class ParameterCheck(Struct):
    max_abs_error: float
    max_rel_error: float
    checked: int  # elements finite differences checked (0 in directional mode)
    # The returned gradient (its dtype, micro-batched, checkpointed, per-loss accumulated) against the
    # float64 autograd reference on the same batch, by the same relative-error rule.
    returned_max_rel_error: float = 0.0
    # How each check judged this tensor: "ratio" (its error relative to its own scale is within the
    # tolerance), "floor" (element by element within atol + tolerance x |gradient|: a tensor small beside
    # the model's gradient), "zero" (its gradient is zero to working precision: no ratio is meaningful,
    # and the headline figures leave it out), "kink" (every checked element straddles a point where the
    # function is not differentiable) or "failed". "" where that check did not look at it.
    judged: str = ""
    returned_judged: str = ""
    # Checked elements whose one-sided differences stay apart at every step tried (a ReLU, max-pool tie,
    # abs or clamp at the point): left out of this tensor's figures, never a failure.
    kinks: int = 0
    # The returned check's relative tolerance for this tensor (the dtype's, widened by the loss's scale
    # and the reductions' length: docs/numcheck.md); 0 where that check did not look at it.
    returned_tolerance: float = 0.0


class QuantityCheck(Struct):
    """A returned quantity other than the gradients, checked its own way (`how`)."""

    how: str
    max_rel_error: float
    tolerance: float
    passed: bool


class Numcheck(Struct):
    mode: str
    eps: float
    dtype: str
    evaluations: int
    max_abs_error: float
    max_rel_error: float
    passed: bool
    tolerance: float
    per_parameter: dict[str, ParameterCheck]
    # The absolute tolerance of the element-wise rule (the largest applied): what float64 and the step
    # resolve for this loss (8 roundings of the loss / eps), or the tolerance x the model's largest
    # gradient element, whichever is larger.
    rounding_floor: float = 0.0
    # The gradients as returned against the float64 reference on the same batch; `passed` needs both
    # checks. Absolute errors below returned_floor (returned_tolerance x the largest reference element)
    # pass whatever their ratio. Mode "off": nothing was checked, `passed` is false and both tolerances 0.
    returned_max_rel_error: float = 0.0
    returned_tolerance: float = 0.0
    returned_floor: float = 0.0
    # Why this mode ran: what `auto` measured and chose, or that the request asked for it.
    reason: str = ""
    # hvp, input_gradient, per_sample and per-loss gradients, each checked its own way; `passed` covers them.
    quantities: dict[str, QuantityCheck] = {}
    # Elements (or directions) found straddling a kink, over all tensors: left out of the figures.
    kinks: int = 0
    # Values the finite differences held at their unperturbed point, as autograd does: each detach() of
    # the forward (graph models), by node and module.
    held: list[str] = []
    # The evaluations the request's budget allows (a function of the model's size and batch, never of a
    # measured time), and what it cut to fit them ("" when nothing was cut).
    budget_evaluations: int = 0
    cut: str = ""


class LayerMemory(Struct):
    name: str
    type: str
    saved_bytes: int
    output_bytes: int
    parameter_bytes: int
    output_shape: list[int] | None = None


class Memory(Struct):
    layers: list[LayerMemory]
    saved_bytes_total: int
    device_peak_bytes: int | None = None


class Timings(Struct):
    """Milliseconds per phase of one job.

    queue_ms     enqueue to a worker's start
    prepare_ms   the request turned into a model, inputs and targets on the device (a spec's first job also
                 builds its seeded initial weights and runs the shape check)
    forward_ms   forward pass, the median over `timing_repeat` passes (accounting hooks excluded)
    backward_ms  backward pass, the same median (options.batch_gradient false: the examples' forward and
                 backward under vmap, forward_ms 0)
    memory_ms    the activation accounting: its saved-tensor hooks and its report (0 with memory off)
    numcheck_ms  the numerical check (0 when off)
    total_ms     prepare to result: every pass (with the warm-up when timing_repeat > 1), the checkpoint
                 comparison and per-sample gradients included; at least the sum of the phases above but queue_ms
    """

    queue_ms: float = 0.0
    prepare_ms: float = 0.0
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    memory_ms: float = 0.0
    numcheck_ms: float = 0.0
    total_ms: float = 0.0


class PerSample(Struct):
    norms: Tensor | None = None
    gradients: dict[str, Tensor] | None = None


class Norms(Struct):
    """L2 norms of the batch gradient before any clipping: the whole, each parameter's, each module's (the
    module path that owns the parameters: the layer index for a layer spec)."""

    global_: float = msgspec.field(name="global")
    parameters: dict[str, float] = {}
    modules: dict[str, float] = {}


class NoiseScale(Struct):
    """McCandlish et al. (2018): with g_n each example's loss gradient and g their mean over N,
    S = sum |g_n - g|^2 / (N - 1) (trace_covariance), |G|^2 = |g|^2 - S / N (gradient_norm_squared),
    b_simple = S / |G|^2; null with the `reason` when |G|^2 <= 0 or N < 2."""

    b_simple: float | None
    trace_covariance: float | None
    gradient_norm_squared: float | None
    reason: str = ""


class Diagnostics(Struct, omit_defaults=True):
    """One entry per name asked for in options.diagnostics. `variance` and `second_moment` are BackPACK's
    Variance and SumGradSquared for the request's loss reduction, per trainable parameter."""

    norms: Norms | None = None
    variance: dict[str, Tensor] | None = None
    second_moment: dict[str, Tensor] | None = None
    noise_scale: NoiseScale | None = None


class ClipResult(Struct, omit_defaults=True):
    """Global clipping: the pre-clip `total_norm` and the `scale` applied to every gradient. Per-sample:
    how many of the `examples` were `clipped`, and the noise's standard deviation (`noise_std`)."""

    total_norm: float | None = None
    scale: float | None = None
    clipped: int | None = None
    examples: int | None = None
    noise_std: float | None = None


class Density(Struct):
    """The stochastic Lanczos quadrature spectrum: Ritz values and their weights (summing to 1)."""

    eigenvalues: list[float]
    weights: list[float]


class Curvature(Struct, omit_defaults=True):
    """What options.curvature asked for. `residuals[i]` is |M v_i - lambda_i v_i| / |lambda_i| for the i-th
    top eigenpair (largest first); `products` counts the matrix-vector products computed; `trace_samples` are
    Hutchinson's per-probe values z^T M z, in probe order (their mean is `trace`)."""

    matrix: str
    top_eigenvalues: list[float] = []
    residuals: list[float] = []
    trace: float | None = None
    trace_stderr: float | None = None
    density: Density | None = None
    products: int = 0
    eigenvectors: list[dict[str, Tensor]] | None = None
    trace_samples: list[float] | None = None


class GraphNode(Struct):
    id: int
    name: str
    next: list[int]


class ShardsInfo(Struct):
    """How a sharded job ran: `rows` per shard in batch order; `critical_path_ms` = the slowest shard's
    total_ms + reduce_ms (what `timings.total_ms` reports), `compute_ms` = every shard's total_ms summed (the
    job's cost on one worker, about); `numcheck_shard` is the shard whose check `numcheck` reports (the worst);
    `curvature_jobs`: the jobs that ran options.curvature's Lanczos runs over the whole batch, after the row
    shards in `shard_total_ms`."""

    count: int
    rows: list[int]
    critical_path_ms: float
    compute_ms: float
    reduce_ms: float
    shard_total_ms: list[float]
    numcheck_shard: int | None = None
    curvature_jobs: int = 0


class GradientResult(Struct, omit_defaults=False):
    device: str
    dtype: str
    parameter_count: int
    torch_version: str
    loss: float
    gradients: dict[str, Tensor | None]
    timings: Timings
    job_id: str = ""
    status: str = "finished"
    micro_batches: int = 1
    losses: dict[str, float] | None = None
    per_loss_gradients: dict[str, dict[str, Tensor | None]] | None = None
    gradient_cosine: dict[str, float] | None = None
    per_sample: PerSample | None = None
    input_gradient: Tensor | None = None
    hvp: dict[str, Tensor | None] | None = None
    graph: list[GraphNode] | None = None
    numcheck: Numcheck | None = None
    memory: Memory | None = None
    # segments and the byte counts are integers; the times and their ratio floats.
    checkpoint: dict[str, int | float] | None = None
    # Graph models: the content hash under which the service keeps the validated graph; send it as
    # `model.graph_ref` (with weights and the batch) instead of the graph on the next request.
    graph_ref: str | None = None
    # Sharded jobs (options.shards > 1) only; `memory` is then the largest shard's.
    shards: ShardsInfo | None = None
    # The seed this job ran with (model.seed): dropout masks and the random HVP vector; send it again to
    # repeat the call exactly.
    seed: int = 0
    # Graph models: the new value of each buffer forward writes (batch norm's running statistics and
    # counters), by state_dict name, as one forward over the whole batch leaves it; null when forward
    # writes none, or when the batch ran in parts (micro_batch, shards).
    buffers: dict[str, Tensor] | None = None
    # options.outputs: forward's outputs, in the structure of the graph's output_tree (tensors as elsewhere).
    outputs: Any = None
    # options.diagnostics, options.clip and options.curvature (null when not asked for).
    diagnostics: Diagnostics | None = None
    clip: ClipResult | None = None
    curvature: Curvature | None = None
    # How the model came to be on the worker's device: "resident" (held from an earlier job of the same owner;
    # only the weights not in place were copied in), "built" (built for this job); null where the worker keeps
    # no model (a reduce job). `copied_bytes`: the bytes copied into the model's tensors on its device for this job.
    prepared: str | None = None
    copied_bytes: int | None = None


class Estimate(Struct):
    parameter_count: int
    memory: Memory


class RunCheck(Struct):
    """A step's numerical check in brief: the mode that ran, its verdict and its largest relative error."""

    mode: str
    passed: bool
    max_rel_error: float


class RunStep(Struct):
    """One recorded step of a run (GET /runs/{name}). Norms are L2 norms of the returned batch gradient
    (before any clipping); a module is a parameter's parent path ("0" for layer 0 of a layer spec,
    "blocks.0.attn" in a graph model; a parameter of the root module is a module of its own). `update_ratio`
    is |w_t - w_(t-1)| / |w_(t-1)| per module against the run's previous step, null on its first step or
    where the previous step's weights were not kept (GRADSVC_RUN_WEIGHTS_MAX_BYTES)."""

    step: int
    job_id: str
    ended_at: str
    loss: float
    grad_norm: float
    module_grad_norms: dict[str, float]
    total_ms: float
    losses: dict[str, float] | None = None
    update_ratio: dict[str, float] | None = None
    noise_scale: float | None = None
    clip: dict[str, Any] | None = None
    numcheck: RunCheck | None = None


class RunSummary(Struct):
    """One entry of GET /runs: a run's name, how many steps it keeps, its last step and when it was updated."""

    name: str
    steps: int
    last_step: int | None
    updated_at: str


class RunInfo(Struct):
    name: str
    steps: list[RunStep]


class ErrorInfo(Struct):
    code: str
    message: str
    detail: dict[str, Any] = {}


class ErrorBody(Struct, omit_defaults=True):
    error: ErrorInfo
    job_id: str | None = None
    status: str | None = None


class Progress(Struct):
    phase: str
    done: int = 0
    total: int = 0


class JobInfo(Struct):
    job_id: str
    status: str
    progress: Progress | None = None
    error: ErrorInfo | None = None
    result: GradientResult | None = None
    enqueued_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None


class JobAccepted(Struct):
    """The 202 answer: the job's status and progress as GET /jobs/{id} gives them at that moment."""

    job_id: str
    status: str
    progress: Progress | None = None


class LayerArgument(Struct):
    """One constructor argument of a layer type, as gradsvc.layers checks it: `kind` (the JSON forms
    accepted), torch's `default` (absent when `required`), the `range` or choices enforced ("" for any)."""

    kind: str
    required: bool
    default: Any = None
    range: str = ""


class LayerInfo(Struct):
    """One entry of GET /layers. `arguments` maps each argument to its kind and range in brief
    ("int >= 1"); `details` gives them apart, with torch's default. `output` is "sequence" for the recurrent layers (their output
    sequence, without the final state)."""

    type: str
    arguments: dict[str, str]
    required: list[str]
    container: bool = False
    details: dict[str, LayerArgument] = {}
    output: str = "tensor"


class ErrorCode(NamedTuple):
    """One error code: its HTTP status, the SDK's exception class, the SDK parent it falls under
    (`request`: the request was wrong; `job`: the job ran and failed; `unavailable`: try again later;
    `server`: a gradsvc bug) and what it means."""

    status: int
    exception: str
    kind: Literal["request", "job", "unavailable", "server"]
    meaning: str


# The one table of error codes: the API renders these statuses, the workers raise these codes, the SDK
# builds its exception classes from it. Only codes something raises are listed (a test checks it).
ERROR_CODES: dict[str, ErrorCode] = {
    "malformed_body": ErrorCode(400, "MalformedBodyError", "request", "the body is not valid JSON or MessagePack"),
    "invalid_body": ErrorCode(400, "InvalidBodyError", "request", "the body does not match the request schema"),
    "invalid_parameter": ErrorCode(400, "InvalidParameterError", "request", "a query or path parameter is invalid"),
    "bad_request": ErrorCode(400, "BadRequestError", "request",
                         "the request is malformed in another way (a header such as Idempotency-Key)"),
    "unauthorized": ErrorCode(401, "UnauthorizedError", "request", "the API key is missing or unknown"),
    "not_found": ErrorCode(404, "NotFoundError", "request", "no such route, or no such job for this API key"),
    "method_not_allowed": ErrorCode(405, "MethodNotAllowedError", "request", "the route does not take this method"),
    "body_too_large": ErrorCode(413, "BodyTooLargeError", "request", "the body is over GRADSVC_MAX_BODY_BYTES"),
    "headers_too_large": ErrorCode(431, "HeadersTooLargeError", "request",
                                   "the request's headers are over GRADSVC_MAX_HEADER_BYTES or GRADSVC_MAX_HEADERS"),
    "unsupported_media_type": ErrorCode(415, "UnsupportedMediaTypeError", "request",
                                        "the body is neither JSON nor MessagePack"),
    "unknown_layer": ErrorCode(422, "UnknownLayerError", "request", "a layer type or argument is not allowed"),
    "shape_mismatch": ErrorCode(422, "ShapeMismatchError", "request", "a layer or op cannot take its input's shape"),
    "bad_weights": ErrorCode(422, "BadWeightsError", "request", "weights are missing, unknown or mis-shaped"),
    "bad_tensor": ErrorCode(422, "BadTensorError", "request", "a tensor is malformed or holds invalid values"),
    "bad_loss": ErrorCode(422, "BadLossError", "request", "the loss is unknown or malformed"),
    "bad_target": ErrorCode(422, "BadTargetError", "request", "the targets do not fit the loss"),
    "bad_option": ErrorCode(422, "BadOptionError", "request", "an option is invalid or cannot apply to the model"),
    "unsupported_op": ErrorCode(422, "UnsupportedOpError", "request", "a graph node names an op outside the allow-list"),
    "no_gradient": ErrorCode(422, "NoGradientError", "request",
                             "the graph's first output has no gradient (an integer tensor, or detached)"),
    "graph_not_found": ErrorCode(422, "GraphNotFoundError", "request",
                                 "model.graph_ref names no graph this service keeps; send the graph again"),
    "tensor_not_found": ErrorCode(422, "TensorNotFoundError", "request",
                                  "a tensor's refs name bytes this service does not keep; upload them again"),
    "too_many_refs": ErrorCode(422, "TooManyRefsError", "request",
                               "a request names more tensor pieces by reference than GRADSVC_MAX_REFS"),
    "too_large": ErrorCode(422, "TooLargeError", "request", "the model or batch is over a size limit"),
    "device_unavailable": ErrorCode(422, "DeviceUnavailableError", "request", "the requested device is not there"),
    # 422 as the IETF's Idempotency-Key draft (draft-ietf-httpapi-idempotency-key-header) answers a key reused
    # with another body: the request is well formed, the key cannot name two requests.
    "idempotency_key_reused": ErrorCode(422, "IdempotencyKeyReusedError", "request",
                                        "an Idempotency-Key was reused for a different request body"),
    "rate_limited": ErrorCode(429, "RateLimitedError", "request", "this API key sent too many jobs; see Retry-After"),
    "non_finite": ErrorCode(422, "NonFiniteError", "job", "the loss or a gradient is NaN or infinite"),
    "canceled": ErrorCode(409, "CanceledError", "job", "the job was canceled"),
    "result_too_large": ErrorCode(413, "ResultTooLargeError", "job", "the result is over GRADSVC_MAX_RESULT_BYTES"),
    "worker_lost": ErrorCode(503, "WorkerLostError", "job", "the worker running the job died or was cut off"),
    "job_lost": ErrorCode(410, "JobLostError", "job",
                          "Redis lost the job's record (restarted without its data); whether it ran is unknown"),
    "input_lost": ErrorCode(410, "InputLostError", "job",
                            "the job's body, handed over as a file (GRADSVC_HANDOFF_DIR), was gone when it ran"),
    "timeout": ErrorCode(504, "JobTimeoutError", "job", "the job ran past GRADSVC_JOB_TIMEOUT_S"),
    "out_of_memory": ErrorCode(507, "OutOfMemoryError", "job", "the device ran out of memory"),
    "result_elsewhere": ErrorCode(421, "ResultElsewhereError", "request",
                                  "the result is a file on another host's GRADSVC_HANDOFF_DIR; ask that host's API"),
    "queue_unavailable": ErrorCode(503, "QueueUnavailableError", "unavailable", "Redis is unreachable"),
    "redis_oom": ErrorCode(503, "RedisOutOfMemoryError", "unavailable",
                           "Redis is at its maxmemory and refuses writes; see Retry-After"),
    "redis_readonly": ErrorCode(503, "RedisReadOnlyError", "unavailable",
                                "Redis is a read-only replica (a failover is in progress or demoted it)"),
    "redis_unavailable": ErrorCode(503, "RedisRefusesWritesError", "unavailable",
                                   "Redis refuses writes (MISCONF: its snapshots fail; NOREPLICAS; MASTERDOWN)"),
    "server_busy": ErrorCode(503, "ServerBusyError", "unavailable",
                             "the API holds GRADSVC_MAX_BODIES_BYTES of request bodies already; see Retry-After"),
    "not_ready": ErrorCode(503, "NotReadyError", "unavailable", "Redis is reachable but no worker is alive"),
    "internal_error": ErrorCode(500, "InternalServerError", "server", "a gradsvc bug; the message says where"),
    # Training sessions (docs/sessions.md)
    "nothing_accumulated": ErrorCode(409, "NothingAccumulatedError", "request",
                                     "optim_step on a session with no gradient accumulated"),
    "too_many_sessions": ErrorCode(429, "TooManySessionsError", "request",
                                   "over GRADSVC_SESSION_MAX_PER_OWNER sessions, or over the owner's byte budget"),
    "workers_full": ErrorCode(503, "WorkersFullError", "request",
                              "the worker holds GRADSVC_SESSION_MAX_PER_WORKER sessions already"),
    "session_resumed": ErrorCode(409, "SessionResumedError", "request",
                                 "the session came back from an older checkpoint: resend the batches from detail.step"),
    "session_lost": ErrorCode(410, "SessionLostError", "job",
                              "the session's checkpoint is gone; its state cannot be rebuilt"),
}


# --- Training sessions (docs/sessions.md): the weights and the optimizer stay on one worker ---------------

SESSION_RETURNS = ("gradients", "weights", "outputs", "buffers")
SessionId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[0-9a-f]{8,64}$")]
IdempotencyKeyField = Annotated[str, Meta(min_length=1, max_length=255)]


class OptimizerSpec(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """torch.optim.SGD, Adam or AdamW; an argument left out (null) takes torch's default. SGD takes lr,
    momentum, dampening, nesterov, weight_decay, maximize; Adam and AdamW take lr, betas, eps, weight_decay,
    amsgrad, maximize."""

    type: Literal["sgd", "adam", "adamw"]
    lr: Annotated[float, Meta(ge=0)] | None = None
    momentum: Annotated[float, Meta(ge=0)] | None = None
    dampening: float | None = None
    nesterov: bool | None = None
    betas: tuple[Annotated[float, Meta(ge=0, lt=1)], Annotated[float, Meta(ge=0, lt=1)]] | None = None
    eps: Annotated[float, Meta(ge=0)] | None = None
    weight_decay: Annotated[float, Meta(ge=0)] | None = None
    amsgrad: bool | None = None
    maximize: bool | None = None


class SessionOptions(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A session's standing options: global clipping before every optimizer step (`clip`, as options.clip of
    POST /gradients; per_sample is refused), the device, how often its state is checkpointed (null: from its
    size, docs/sessions.md) and the parameters left out of the optimizer (`freeze`)."""

    clip: ClipOptions | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    checkpoint_every: AtLeastOne | None = None
    freeze: list[str] = []


class SessionCreate(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """POST /sessions: the model (its weights inline or by reference), the optimizer, the options and an
    optional run name under which each optimizer step is recorded (GET /runs/{name})."""

    model: ModelSpec
    optimizer: OptimizerSpec
    options: SessionOptions = msgspec.field(default_factory=SessionOptions)
    run: RunName | None = None


class SessionCreated(Struct):
    session_id: str
    step: int
    parameter_count: int
    device: str
    checkpoint_every: int
    state_bytes: int


class SessionBatch(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """POST /sessions/{id}/step and /forward_backward: a batch as POST /gradients takes it. `lr` replaces the
    learning rate from this step on (the schedule is the client's); `return` asks for the gradients (before
    the update, after clipping, in options.gradient_dtype), the weights and buffers after it, forward's
    outputs; `idempotency_key` (or the Idempotency-Key header) makes a retried step answer again, not run."""

    inputs: Inputs
    targets: Any = None
    loss: str | LossSpec | None = None
    losses: Annotated[list[LossSpec], NonEmpty] | None = None
    options: Options = msgspec.field(default_factory=Options)
    lr: Annotated[float, Meta(ge=0)] | None = None
    returns: list[Literal["gradients", "weights", "outputs", "buffers"]] = msgspec.field(default_factory=list,
                                                                                         name="return")
    idempotency_key: IdempotencyKeyField | None = None


class SessionOptimStep(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """POST /sessions/{id}/optim_step: the accumulated gradients clipped and applied, then zeroed."""

    lr: Annotated[float, Meta(ge=0)] | None = None
    returns: list[Literal["gradients", "weights", "buffers"]] = msgspec.field(default_factory=list, name="return")
    idempotency_key: IdempotencyKeyField | None = None


class SessionTimings(Struct):
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    total_ms: float = 0.0


class SessionStepResult(Struct, omit_defaults=False):
    """What a session operation answers. `step` counts the optimizer steps applied so far (after this call);
    `accumulated` the forward_backward passes whose gradients wait for optim_step; `grad_norm` the L2 norm of the
    gradient the optimizer step used, before clipping (null on forward_backward); `resumed_from` the checkpoint's
    step when this call restored the session on another worker (the steps after it were lost: replay them)."""

    session_id: str
    step: int
    accumulated: int
    loss: float | None = None
    losses: dict[str, float] | None = None
    grad_norm: float | None = None
    lr: float | None = None
    clip: ClipResult | None = None
    gradients: dict[str, Tensor | None] | None = None
    weights: dict[str, Tensor] | None = None
    buffers: dict[str, Tensor] | None = None
    outputs: Any = None
    device: str = ""
    worker: str = ""
    resumed_from: int | None = None
    replayed: bool = False
    timings: SessionTimings = msgspec.field(default_factory=SessionTimings)
    # options.numcheck "exact", "sampled" or "directional": the check of this batch's gradient (before clipping),
    # as POST /gradients runs it; null otherwise ("auto" is off in a session: a check costs many passes).
    numcheck: Numcheck | None = None
    # options.diagnostics ["norms"]: the batch gradient's norms (before clipping); the per-example diagnostics
    # need per-sample gradients, which a session step does not compute.
    diagnostics: Diagnostics | None = None


class SessionInfo(Struct):
    """GET /sessions/{id}: where the session stands."""

    session_id: str
    step: int
    accumulated: int
    optimizer: OptimizerSpec
    parameter_count: int
    state_bytes: int
    device: str
    worker: str
    checkpoint_step: int | None
    checkpoint_every: int
    run: str | None
    created_at: float
    last_used_at: float
    last: SessionStepResult | None = None

JSON_ENCODER = msgspec.json.Encoder()
MSGPACK_ENCODER = msgspec.msgpack.Encoder()
