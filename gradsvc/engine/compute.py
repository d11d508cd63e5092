"""compute(request) -> GradientResult, read as TorchServe's handler reads: preprocess (prepare: the request
validated into a Prepared, on the device), inference (the timed passes; the options around them: activation
memory, checkpointing's trade-off, per-sample gradients, diagnostics; the numerical check), postprocess (per-phase
timings, the wire result: every tensor encoded, a frozen parameter's gradient null, the cosines between per-loss
gradients). Each stage takes one Run. Pure PyTorch: no Redis, no HTTP, no environment."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field

import msgspec
import torch

from gradsvc.wire import GradientRequest, GradientResult, Memory, Numcheck, Timings

from . import diagnostics, outputs, tensors
from .config import EngineCaches, EngineConfig
from .devices import (float32_math, is_allocation_failure, math_mode_for, one_cpu_thread, out_of_memory,
                      resolve_device, sync)
from .errors import ComputeError
from .numcheck import CheckInputs, ProgressCallback, computed_dtype, numerical_check
from .passes import Pass, non_finite_error, run_pass, trainable
from .prepare import prepare, release
from .prepared import GraphResolver, Prepared, batch_chunks
from .quantities import Examples, hvp_vector_for, per_sample_gradients


def compute(request: GradientRequest, config: EngineConfig | None = None, *, progress: ProgressCallback | None = None,
            device: torch.device | None = None, graphs: GraphResolver | None = None,
            reference: dict[str, torch.Tensor] | None = None, caches: EngineCaches | None = None) -> GradientResult:
    """Everything POST /gradients answers, computed in this process. `graphs` resolves model.graph_ref
    (the workers pass their Redis-backed store). `reference`, when given, receives the numerical check's
    float64 autograd gradients (a shard's, for the returned-gradient check of the combined gradient).
    `caches` are the calling Engine's (None: a one-off call, with caches of its own)."""
    config = config or EngineConfig()
    device = device or resolve_device(request.options.device)
    return execute(Run(request, config, device, progress, reference), graphs, caches)


def execute(run: "Run", graphs: GraphResolver | None = None, caches: EngineCaches | None = None,
            scope: str | None = None) -> GradientResult:
    """compute() of a Run made by the caller; `scope`: whose resident models it may use (Engine.compute passes the
    job's owner: resident.py). Running out of memory is a coded out_of_memory, and empties the resident pool."""
    caches = caches if caches is not None else EngineCaches.for_config(run.config)
    device = run.device
    try:
        return _compute(run, graphs, caches, scope)
    except torch.cuda.OutOfMemoryError as exc:
        caches.resident_models.clear()  # what the pool holds goes first: the next job may need it
        failed = out_of_memory(device, exc)
    except (MemoryError, RuntimeError) as exc:  # cuBLAS/cuDNN report some allocation failures as plain RuntimeErrors
        if isinstance(exc, RuntimeError) and not is_allocation_failure(exc):
            raise
        caches.resident_models.clear()
        failed = out_of_memory(device, exc)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # Raised outside the handler, so that it carries no context: the allocation failure's traceback holds the
    # failed job's frames and, through them, every tensor it had on the device, for as long as the error lives.
    raise failed


@dataclass
class Run:
    """One compute() call as its stages hand it on: the request and the call's arguments, what preprocess
    made of them (`prep`), and what inference adds for postprocess."""

    request: GradientRequest
    config: EngineConfig
    device: torch.device
    progress: ProgressCallback | None = None
    reference: dict[str, torch.Tensor] | None = None  # receives the check's float64 autograd gradients
    math_mode: str = "ieee"  # the float32 math the passes run in (devices.float32_math)
    resting_bytes: int = 0  # what the device's allocator held when the job started (CUDA)
    started: float = field(default_factory=time.perf_counter)
    # preprocess
    prep: Prepared = field(init=False)
    prepare_s: float = 0.0
    # inference
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # the trainable parameters
    hvp_vector: dict[str, torch.Tensor] | None = None
    passes: list[Pass] = field(default_factory=list)  # the warm-up (when repeating), then the timed passes
    examples: Examples | None = None  # the per-example pass, when one ran
    computed: dict[str, torch.Tensor] = field(default_factory=dict)  # the gradients before options.gradient_dtype
    memory: Memory | None = None
    memory_s: float = 0.0  # a phase that did not run took no time, not a timer's jitter
    checkpoint: dict[str, int | float] | None = None
    diagnosed: diagnostics.Outcome = field(default_factory=diagnostics.Outcome)
    check: Numcheck | None = None
    numcheck_s: float = 0.0

    @property
    def final(self) -> Pass:
        """The last pass: the metered one, whose gradients are returned."""
        return self.passes[-1]

    @property
    def seed(self) -> int:
        return self.request.model.seed

    @property
    def is_tiny(self) -> bool:
        return self.prep.parameter_count * self.prep.inputs.numel() <= TINY_JOB_WORK


# A job this small (parameters x input elements <= ATen's grain size of 32768, which bounds each op's output
# for Linear- and Conv-like layers) runs each kernel inline on one thread anyway, yet with more intra-op
# threads every op still pays the OpenMP team's wake-ups, which on a loaded machine cost milliseconds (the
# 6-8-3 tanh net's job in process: 1.2 ms on one thread, 9.7 ms on two with the other core busy). So tiny CPU jobs run
# on one thread, the process's count restored after; the kernels, hence the answer, are the same.
TINY_JOB_WORK = 1 << 15


def _compute(run: "Run", graphs: GraphResolver | None, caches: EngineCaches, scope: str | None) -> GradientResult:
    """TorchServe's handle(): preprocess, inference, postprocess, in the job's float32 math (options.math_mode,
    else the worker's setting; "ieee" wherever TF32 cannot run)."""
    run.math_mode = math_mode_for(run.device, run.request.options.math_mode or run.config.float32_math)
    with float32_math(run.math_mode, run.device):
        run = _preprocess(run, graphs, caches, scope)
        with one_cpu_thread(run.device, run.is_tiny):
            _inference(run)
            result = _postprocess(run)
    release(run.prep, caches)  # after a success only: a failed compute's model is dropped
    return result


def _preprocess(run: Run, graphs: GraphResolver | None, caches: EngineCaches | None, scope: str | None = None) -> Run:
    """The request validated and prepared on the run's device (its model, inputs, targets, loss terms)."""
    if run.device.type == "cuda":  # the job's own peak is counted from what the worker holds now
        torch.cuda.reset_peak_memory_stats(run.device)
        run.resting_bytes = torch.cuda.memory_allocated(run.device)
    run.prep = prepare(run.request, run.config, run.device, graphs=graphs, caches=caches, scope=scope)
    sync(run.device)  # the copies to the device belong to prepare_ms, not to the first timed pass
    run.prepare_s = time.perf_counter() - run.started
    return run


def _inference(run: Run) -> None:
    """The passes, what the options add around them, and the numerical check of it all."""
    run.params = trainable(run.prep)
    run.hvp_vector = hvp_vector_for(run.request, run.params, run.config)
    _passes(run)
    _memory(run)
    if run.prep.options.checkpoint_segments:
        run.checkpoint = _checkpoint_tradeoff(run)
    _per_example(run)
    _numerical_check(run)
    run.final.grads = run.diagnosed.returned(run.final.grads)


def _postprocess(run: Run) -> GradientResult:
    """The wire result, with the per-phase timings (the passes' median when repeated)."""
    timed = run.passes[1:] if len(run.passes) > 1 else run.passes
    timings = Timings(
        prepare_ms=1e3 * run.prepare_s,
        forward_ms=1e3 * statistics.median(p.forward_s for p in timed),
        backward_ms=1e3 * statistics.median(p.backward_s for p in timed),
        numcheck_ms=1e3 * run.numcheck_s,
        memory_ms=1e3 * run.memory_s,
        total_ms=1e3 * (time.perf_counter() - run.started),
    )
    return run.diagnosed.into(encode_result(run, timings))


def _passes(run: Run) -> None:
    """The batch's timed passes; or, with options.batch_gradient false, the examples' pass alone (its loss,
    no gradient of the batch). The gradients returned are cast to options.gradient_dtype."""
    prep = run.prep
    opts = prep.options
    if opts.batch_gradient:
        run.passes = _timed_passes(run)
    else:
        run.examples = per_sample_gradients(prep, run.params, run.seed, run.device, summed=opts.numcheck != "off")
        loss = sum(t.weight * run.examples.losses[t.name] for t in prep.terms)
        if not math.isfinite(loss):
            raise non_finite_error(prep, loss)
        run.passes = [Pass(loss=loss, losses=run.examples.losses, backward_s=run.examples.seconds)]
    final = run.final
    _refuse_non_finite_gradients(final)
    run.computed = final.grads
    if opts.gradient_dtype is not None:  # what the caller gets, and what the returned-gradient check judges
        final.grads = {n: g.to(tensors.TORCH_DTYPES[opts.gradient_dtype]) for n, g in final.grads.items()}


def _timed_passes(run: Run) -> list[Pass]:
    """timing_repeat passes (plus one warm-up pass, not timed, when repeating); the last one is metered."""
    prep, progress = run.prep, run.progress
    repeat = prep.options.timing_repeat
    if progress:
        progress("forward", 0, repeat)
    runs: list[Pass] = []
    total = repeat + (1 if repeat > 1 else 0)
    for r in range(total):
        runs.append(run_pass(prep, run.params, run.device, record_memory=prep.options.memory and r == total - 1,
                             hvp_vector=run.hvp_vector, seed=run.seed))
        if progress:
            progress("backward", r + 1, repeat)
    return runs


def _refuse_non_finite_gradients(final: Pass) -> None:
    if tensors.all_finite_many(list(final.grads.values())):  # on a GPU: one synchronisation for them all
        return
    for name, g in final.grads.items():
        if not tensors.all_finite(g):
            raise ComputeError("non_finite", f"the gradient of {name!r} holds NaN or infinite values while the loss "
                               f"is {final.loss}; lower the inputs' scale or check the weights", parameter=name)


def _memory(run: Run) -> None:
    """The metered pass's activation memory, and the job's own peak on the device (CUDA): the allocator's
    peak since the job started, less what the worker held then (resident weights, caches of earlier jobs)."""
    meter = run.final.meter
    if meter:
        peak = (torch.cuda.max_memory_allocated(run.device) - run.resting_bytes if run.device.type == "cuda"
                else None)
        memory_started = time.perf_counter()
        run.memory = meter.report(peak)
        run.memory_s = (time.perf_counter() - memory_started) + meter.hook_s


def _checkpoint_tradeoff(run: Run) -> dict[str, int | float]:
    """The same pass without checkpointing: what checkpointing saved in memory and cost in time."""
    prep, with_ckpt = run.prep, run.final
    plain_prep = dataclasses.replace(prep, options=msgspec.structs.replace(prep.options, checkpoint_segments=None))
    plain = run_pass(plain_prep, run.params, run.device, record_memory=True, hvp_vector=None, seed=run.seed)
    saved_plain = plain.meter.report().saved_bytes_total if plain.meter else 0
    saved_ckpt = run.memory.saved_bytes_total if run.memory else 0
    t_plain = plain.forward_s + plain.backward_s
    t_ckpt = with_ckpt.forward_s + with_ckpt.backward_s
    return {
        "segments": int(prep.options.checkpoint_segments or 0),
        "saved_bytes_without": int(saved_plain),
        "saved_bytes_with": int(saved_ckpt),
        "memory_saved_bytes": int(saved_plain - saved_ckpt),
        "forward_backward_ms_without": 1e3 * t_plain,
        "forward_backward_ms_with": 1e3 * t_ckpt,
        "time_ratio": t_ckpt / t_plain if t_plain > 0 else 0.0,
    }


def _per_example(run: Run) -> None:
    """The examples' pass where per-sample gradients or a diagnostic need it, and the diagnostics."""
    prep, opts = run.prep, run.prep.options
    if (opts.per_sample != "off" or diagnostics.wants_examples(opts)) and run.examples is None:
        run.examples = per_sample_gradients(prep, run.params, run.seed, run.device, summed=opts.numcheck != "off")
    examples = run.examples
    run.diagnosed = diagnostics.run(prep, run.params, run.device, run.seed, run.computed,
                                    examples and examples.gradients, run.progress)


def _numerical_check(run: Run) -> None:
    """The numerical check; without the batch's gradient it judges what was computed: the examples'
    gradients summed."""
    if run.progress:
        run.progress("numcheck", 0, 1)
    numcheck_started = time.perf_counter()
    per_sample_sum = run.examples.summed if run.examples is not None else None
    final = run.final
    returned = final.grads if run.prep.options.batch_gradient else {
        n: g.to(computed_dtype(run.prep)) for n, g in (per_sample_sum or {}).items()}
    run.check = numerical_check(CheckInputs(run.prep, run.request, run.config, run.device, returned, run.progress,
                                            run.reference, final=final, hvp_vector=run.hvp_vector,
                                            per_sample_sum=per_sample_sum, math_mode=run.math_mode))
    ran = run.check is not None and run.check.mode != "off"
    run.numcheck_s = time.perf_counter() - numcheck_started if ran else 0.0


def encode_result(run: Run, timings: Timings) -> GradientResult:
    """The wire result: every tensor encoded, a frozen parameter's gradient null."""
    prep, final = run.prep, run.final
    opts = prep.options
    several = len(prep.terms) > 1
    host = tensors.to_host if run.device.type == "cuda" else _as_they_are  # a GPU's: one flat copy and wait a dict
    grads = host(final.grads)
    gradients = {n: (tensors.encode(grads[n]) if n in grads else None) for n, _ in prep.model.named_parameters()}
    per_loss = {t: host(g) for t, g in final.per_loss.items()} if final.per_loss else None
    hvp = host(final.hvp) if run.hvp_vector is not None else None
    return GradientResult(
        device=str(run.device),
        dtype=run.request.model.dtype,
        math_mode=run.math_mode,
        parameter_count=prep.parameter_count,
        torch_version=str(torch.__version__),
        loss=final.loss,
        gradients=gradients,
        micro_batches=len(batch_chunks(prep.inputs.rows, opts.micro_batch)),
        losses=dict(final.losses) if several else None,
        per_loss_gradients=({t: {n: (tensors.encode(g[n]) if n in g else None) for n in gradients}
                             for t, g in per_loss.items()} if per_loss else None),
        gradient_cosine=cosines(final.per_loss) if final.per_loss else None,
        per_sample=run.examples.per_sample if run.examples is not None and opts.per_sample != "off" else None,
        input_gradient=tensors.encode(torch.cat(final.input_grad)) if opts.input_grad else None,
        hvp={n: (tensors.encode(hvp[n]) if n in hvp else None) for n in gradients} if hvp is not None else None,
        graph=final.graph,
        numcheck=run.check,
        memory=run.memory,
        checkpoint=run.checkpoint,
        timings=timings,
        graph_ref=prep.graph.ref if prep.graph is not None else None,
        seed=run.request.model.seed,
        buffers={n: tensors.encode(b) for n, b in final.buffers.items()} if final.buffers else None,
        outputs=_outputs(prep, final),
        prepared=prep.prepared,
        copied_bytes=prep.copied_bytes if prep.prepared is not None else None,
        capture=prep.graph.spec.capture if prep.graph is not None else None,
        specialised=prep.graph.spec.specialised if prep.graph is not None else None,
    )


def _as_they_are(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return named


def _outputs(prep: Prepared, final: Pass):
    """options.outputs: forward's outputs in the structure it returns them (graph models)."""
    if final.outputs is None or prep.graph is None:
        return None
    return outputs.as_returned(outputs.tree_of(prep.graph.spec), final.outputs, prep.graph.first_output)


def cosines(per_loss: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """The cosine between every pair of per-loss gradients ("a|b"): negative when the tasks pull apart."""
    flat = {k: torch.cat([g.reshape(-1).to(torch.float64) for g in v.values()]) for k, v in per_loss.items()}
    names = list(flat)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            denom = float(flat[a].norm() * flat[b].norm())
            out[f"{a}|{b}"] = float(flat[a] @ flat[b]) / denom if denom > 0 else 0.0
    return out
