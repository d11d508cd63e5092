"""A job's answer: the GradientResult, its numerical check, memory and timings."""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from gradsvc.wire.diagnostics import ClipResult, Curvature, Diagnostics
from gradsvc.wire.graphs import Capture, Specialised
from gradsvc.wire.tensors import Tensor


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
    # function is not differentiable), "unsettled" (every element left has a central difference still moving at
    # the smallest step: the loss curves too sharply there to measure), "failed", or (returned_judged only)
    # "unresolved" (the job's dtype resolves this gradient no better than a tolerance's 0.25 ceiling: not
    # judged). "" where that check did not look at it.
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
    # true or false: the check ran and held or not; null: it did not run (mode "off"), nothing was judged.
    passed: bool | None
    tolerance: float
    per_parameter: dict[str, ParameterCheck]
    # The absolute tolerance of the element-wise rule (the largest applied): what float64 and the step
    # resolve for this loss (8 roundings of the loss / eps), or the tolerance x the model's largest
    # gradient element, whichever is larger.
    rounding_floor: float = 0.0
    # The gradients as returned against the float64 reference on the same batch; `passed` needs both
    # checks. Absolute errors below returned_floor (returned_tolerance x the largest reference element)
    # pass whatever their ratio. Mode "off": nothing was checked, `passed` is null and both tolerances 0.
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
    # The float32 math the job ran in: "ieee" or "tf32" (only on a CUDA device that has it; never on a CPU).
    math_mode: str = "ieee"
    # How the model came to be on the worker's device: "resident" (held from an earlier job of the same owner;
    # only the weights not in place were copied in), "built" (built for this job); null where the worker keeps
    # no model (a reduce job). `copied_bytes`: the bytes copied into the model's tensors on its device for this job.
    prepared: str | None = None
    copied_bytes: int | None = None
    # Graph models: how the module was captured ("export", "export_static", "draft", "trace") and what that capture
    # is specialised to, its guards (inputs' shapes, values read from tensors, data-dependent sizes), as the graph
    # says (GraphSpec.capture and .specialised); null for a layer spec or a graph that does not say.
    capture: Capture | None = None
    specialised: Specialised | None = None
    # How many jobs of a worker's take ran as one batched computation with this one (GRADSVC_WORKER_TAKE > 1,
    # docs/performance.md): k; null when the job was computed alone.
    combined: int | None = None
