"""compute(request) -> GradientResult: prepare, the timed passes, the options around them (checkpointing's
trade-off, per-sample gradients), the numerical check, activation memory and per-phase timings; then the wire
result: every tensor encoded, a frozen parameter's gradient null, the cosines between per-loss gradients.
Pure PyTorch: no Redis, no HTTP, no environment."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import msgspec
import torch

from gradsvc.wire import GradientRequest, GradientResult, Timings

from . import diagnostics, outputs, tensors
from .check import computed_dtype, numerical_check
from .config import EngineCaches, EngineConfig
from .devices import is_allocation_failure, one_cpu_thread, out_of_memory, resolve_device, sync
from .errors import ComputeError
from .numcheck import ProgressCallback
from .passes import Pass, non_finite_error, run_pass, trainable
from .prepare import prepare, release
from .prepared import GraphResolver, Prepared, batch_chunks
from .quantities import hvp_vector_for, per_sample_gradients


def compute(request: GradientRequest, config: EngineConfig | None = None, *, progress: ProgressCallback | None = None,
            device: torch.device | None = None, graphs: GraphResolver | None = None,
            reference: dict[str, torch.Tensor] | None = None, caches: EngineCaches | None = None) -> GradientResult:
    """Everything POST /gradients answers, computed in this process. `graphs` resolves model.graph_ref
    (the workers pass their Redis-backed store). `reference`, when given, receives the numerical check's
    float64 autograd gradients (a shard's, for the returned-gradient check of the combined gradient).
    `caches` are the calling Engine's (None: a one-off call, with caches of its own)."""
    config = config or EngineConfig()
    caches = caches if caches is not None else EngineCaches.for_config(config)
    device = device or resolve_device(request.options.device)
    try:
        return _compute(request, config, progress, device, graphs, reference, caches)
    except torch.cuda.OutOfMemoryError as exc:
        raise out_of_memory(device, exc) from None
    except (MemoryError, RuntimeError) as exc:  # cuBLAS/cuDNN report some allocation failures as plain RuntimeErrors
        if isinstance(exc, RuntimeError) and not is_allocation_failure(exc):
            raise
        caches.resident_models.clear()  # what the pool holds goes first: the next job may need it
        raise out_of_memory(device, exc) from None
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _compute(request: GradientRequest, config: EngineConfig, progress: ProgressCallback | None,
             device: torch.device, graphs: GraphResolver | None = None,
             reference: dict[str, torch.Tensor] | None = None, caches: EngineCaches | None = None) -> GradientResult:
    started = time.perf_counter()
    prep = prepare(request, config, device, graphs=graphs, caches=caches)
    sync(device)  # the copies to the device belong to prepare_ms, not to the first timed pass
    prepare_s = time.perf_counter() - started
    with one_cpu_thread(device, prep.parameter_count * prep.inputs.numel() <= TINY_JOB_WORK):
        result = _compute_prepared(request, config, progress, device, reference, prep, started, prepare_s)
    release(prep, caches)  # after a success only: a failed compute's model is dropped
    return result


# A job this small (parameters x input elements <= ATen's grain size of 32768, which bounds each op's output
# for Linear- and Conv-like layers) runs each kernel inline on one thread anyway, yet with more intra-op
# threads every op still pays the OpenMP team's wake-ups, which on a loaded machine cost milliseconds (the
# 6-8-3 tanh net's job in process: 1.2 ms on one thread, 9.7 ms on two with the other core busy). So tiny CPU jobs run
# on one thread, the process's count restored after; the kernels, hence the answer, are the same.
TINY_JOB_WORK = 1 << 15


def _compute_prepared(request: GradientRequest, config: EngineConfig, progress: ProgressCallback | None,
                      device: torch.device, reference: dict[str, torch.Tensor] | None, prep: Prepared,
                      started: float, prepare_s: float) -> GradientResult:
    opts = prep.options
    params = trainable(prep)
    hvp_vector = hvp_vector_for(request, params, config)
    seed = request.model.seed
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    examples = None
    if opts.batch_gradient:
        runs = _timed_passes(prep, params, device, hvp_vector, seed, progress)
    else:  # the examples' pass alone: its loss, no gradient of the batch
        examples = per_sample_gradients(prep, params, seed, device, summed=opts.numcheck != "off")
        loss = sum(t.weight * examples.losses[t.name] for t in prep.terms)
        if not math.isfinite(loss):
            raise non_finite_error(prep, loss)
        runs = [Pass(loss=loss, losses=examples.losses, backward_s=examples.seconds)]
    final = runs[-1]
    _check_gradients(final)
    computed = final.grads
    if opts.gradient_dtype is not None:  # what the caller gets, and what the returned-gradient check judges
        final.grads = {n: g.to(tensors.TORCH_DTYPES[opts.gradient_dtype]) for n, g in final.grads.items()}
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    memory, memory_s = None, 0.0  # a phase that did not run took no time, not a timer's jitter
    if final.meter:
        memory_started = time.perf_counter()
        memory = final.meter.report(peak)
        memory_s = (time.perf_counter() - memory_started) + final.meter.hook_s

    checkpoint = None
    if opts.checkpoint_segments:
        checkpoint = _checkpoint_tradeoff(prep, params, device, seed, final, memory)

    if (opts.per_sample != "off" or diagnostics.wants_examples(opts)) and examples is None:
        examples = per_sample_gradients(prep, params, seed, device, summed=opts.numcheck != "off")
    per_sample = examples.per_sample if examples is not None and opts.per_sample != "off" else None
    diagnosed = diagnostics.run(prep, params, device, seed, computed, examples and examples.gradients)
    per_sample_sum = examples.summed if examples is not None else None

    if progress:
        progress("numcheck", 0, 1)
    numcheck_started = time.perf_counter()
    # without the batch's gradient the check judges what was computed: the examples' gradients summed
    returned = final.grads if opts.batch_gradient else {
        n: g.to(computed_dtype(prep)) for n, g in (per_sample_sum or {}).items()}
    check = numerical_check(prep, request, config, device, progress, returned, reference,
                      job_s=final.forward_s + final.backward_s, final=final, hvp_vector=hvp_vector,
                      per_sample_sum=per_sample_sum)
    numcheck_s = time.perf_counter() - numcheck_started if check is not None and check.mode != "off" else 0.0
    final.grads = diagnosed.returned(final.grads)

    timed = runs[1:] if len(runs) > 1 else runs
    timings = Timings(
        prepare_ms=1e3 * prepare_s,
        forward_ms=1e3 * statistics.median(p.forward_s for p in timed),
        backward_ms=1e3 * statistics.median(p.backward_s for p in timed),
        numcheck_ms=1e3 * numcheck_s,
        memory_ms=1e3 * memory_s,
        total_ms=1e3 * (time.perf_counter() - started),
    )
    return diagnosed.into(encode_result(request, prep, device, final, per_sample=per_sample,
                                        hvp=hvp_vector is not None, check=check, memory=memory,
                                        checkpoint=checkpoint, timings=timings))


def _timed_passes(prep: Prepared, params: dict[str, torch.Tensor], device: torch.device,
                  hvp_vector: dict[str, torch.Tensor] | None, seed: int, progress: ProgressCallback | None) -> list[Pass]:
    """timing_repeat passes (plus one warm-up pass, not timed, when repeating); the last one is metered."""
    repeat = prep.options.timing_repeat
    if progress:
        progress("forward", 0, repeat)
    runs: list[Pass] = []
    total = repeat + (1 if repeat > 1 else 0)
    for r in range(total):
        runs.append(run_pass(prep, params, device, record_memory=prep.options.memory and r == total - 1,
                              hvp_vector=hvp_vector, seed=seed))
        if progress:
            progress("backward", r + 1, repeat)
    return runs


def _check_gradients(final: Pass) -> None:
    for name, g in final.grads.items():
        if not tensors.all_finite(g):
            raise ComputeError("non_finite", f"the gradient of {name!r} holds NaN or infinite values while the loss "
                               f"is {final.loss}; lower the inputs' scale or check the weights", parameter=name)


def _checkpoint_tradeoff(prep: Prepared, params: dict[str, torch.Tensor], device: torch.device, seed: int,
                         with_ckpt: Pass, memory) -> dict[str, int | float]:
    """The same pass without checkpointing: what checkpointing saved in memory and cost in time."""
    plain_prep = dataclasses.replace(prep, options=msgspec.structs.replace(prep.options, checkpoint_segments=None))
    plain = run_pass(plain_prep, params, device, record_memory=True, hvp_vector=None, seed=seed)
    saved_plain = plain.meter.report().saved_bytes_total if plain.meter else 0
    saved_ckpt = memory.saved_bytes_total if memory else 0
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


def encode_result(request: GradientRequest, prep: Prepared, device: torch.device, final: Pass, *, per_sample,
                  hvp: bool, check, memory, checkpoint, timings: Timings) -> GradientResult:
    """The wire result: every tensor encoded, a frozen parameter's gradient null."""
    opts = prep.options
    several = len(prep.terms) > 1
    gradients = {n: (tensors.encode(final.grads[n]) if n in final.grads else None)
                 for n, _ in prep.model.named_parameters()}
    return GradientResult(
        device=str(device),
        dtype=request.model.dtype,
        parameter_count=prep.parameter_count,
        torch_version=str(torch.__version__),
        loss=final.loss,
        gradients=gradients,
        micro_batches=len(batch_chunks(prep.inputs.rows, opts.micro_batch)),
        losses=dict(final.losses) if several else None,
        per_loss_gradients=({t: {n: (tensors.encode(g[n]) if n in g else None) for n in gradients}
                             for t, g in final.per_loss.items()} if final.per_loss else None),
        gradient_cosine=cosines(final.per_loss) if final.per_loss else None,
        per_sample=per_sample,
        input_gradient=tensors.encode(torch.cat(final.input_grad)) if opts.input_grad else None,
        hvp={n: (tensors.encode(final.hvp[n]) if n in final.hvp else None) for n in gradients} if hvp else None,
        graph=final.graph,
        numcheck=check,
        memory=memory,
        checkpoint=checkpoint,
        timings=timings,
        graph_ref=prep.graph.ref if prep.graph is not None else None,
        seed=request.model.seed,
        buffers={n: tensors.encode(b) for n, b in final.buffers.items()} if final.buffers else None,
        outputs=_outputs(prep, final),
    )


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
