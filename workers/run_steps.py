"""A run's step as the worker records it (docs/runs.md): the L2 norms of the returned gradients (global and per
module), the update ratio per module against the run's previous step's weights, the loss and the check in
brief; written by the job's success transaction (gradsvc/broker/runs.py), so a step exists once its job finished.

The update ratio needs w_(t-1) when step t arrives, on whichever worker takes it: the run keeps the previous
step's weights in Redis (their raw bytes, what the request carried), replaced at each step. Norms alone cannot
give |w_t - w_(t-1)|, and a sketch would only approximate it; weights sent by reference could be kept as their
refs, but the SDK sends the weights a loop changes in the body, so the bytes are what there is. A model larger
than GRADSVC_RUN_WEIGHTS_MAX_BYTES keeps none and records no ratio."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Callable

import msgspec
import numpy as np

from gradsvc.broker.runs import RunBounds, RunStore
from gradsvc.engine import tensors
from gradsvc.wire import ITEMSIZE, GradientRequest, GradientResult, RunCheck, RunStep, Tensor, raw_data

_weights_encoder = msgspec.msgpack.Encoder()
_weights_decoder = msgspec.msgpack.Decoder(dict[str, Tensor])
_ANY_SIZE = 1 << 62  # decode's element bound: these tensors were bounded when the job decoded them


def module_of(name: str) -> str:
    """A parameter's module: its parent path; a parameter of the root module is a module of its own."""
    parent, _, _ = name.rpartition(".")
    return parent or name


# The wire dtypes numpy reads from raw little-endian bytes; others (bfloat16) go through torch.
_NUMPY = {"float64": "<f8", "float32": "<f4", "float16": "<f2"}


def _flat(t: Tensor, name: str) -> np.ndarray:
    """A wire tensor's elements as one float64 vector. numpy, not torch: a step's tensors are a small job's
    few small ones, where torch's per-call overhead (~20 us) would be most of the recording's cost."""
    raw = raw_data(t)
    if raw is not None and t.dtype in _NUMPY:
        return np.frombuffer(raw, dtype=_NUMPY[t.dtype]).astype(np.float64)
    if isinstance(t.data, list):
        return np.asarray(t.data, dtype=np.float64).reshape(-1)
    return tensors.decode(t, where=name, max_elements=_ANY_SIZE).double().reshape(-1).numpy()


def _by_module(names: list[str], squares: list[float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, sq in zip(names, squares):
        module = module_of(name)
        out[module] = out.get(module, 0.0) + sq
    return out


def gradient_norms(gradients: dict[str, np.ndarray]) -> tuple[float, dict[str, float]]:
    """The global L2 norm and each module's (over the parameters under its path), in float64."""
    squares = _by_module(list(gradients), [float(np.dot(g, g)) for g in gradients.values()])
    return math.sqrt(sum(squares.values())), {m: math.sqrt(s) for m, s in squares.items()}


def update_ratios(previous: dict[str, np.ndarray], current: dict[str, np.ndarray]) -> dict[str, float]:
    """|w_t - w_(t-1)| / |w_(t-1)| per module, over the parameters both steps carry with the same size."""
    names = [n for n, w in current.items() if n in previous and previous[n].shape == w.shape]
    moved = _by_module(names, [float(np.dot(d, d)) for d in (current[n] - previous[n] for n in names)])
    base = _by_module(names, [float(np.dot(previous[n], previous[n])) for n in names])
    return {m: math.sqrt(moved[m] / base[m]) for m in moved if base[m] > 0}


def _field(obj: Any, name: str) -> Any:
    """A result's field or a dict's entry, None when absent: the diagnostics may or may not be there."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _extras(result: GradientResult) -> tuple[float | None, dict | None]:
    """The noise scale (B_simple) and the clip figures when the request asked for them (options.diagnostics,
    options.clip)."""
    noise = _field(_field(result, "diagnostics"), "noise_scale")
    b_simple = _field(noise, "b_simple")
    clip = _field(result, "clip")
    return (None if b_simple is None else float(b_simple)), (None if clip is None else msgspec.to_builtins(clip))


def _before_clipping(grad_norm: float, modules: dict[str, float], clip: Any) -> tuple[float, dict[str, float]]:
    """The norms of the gradient before a global clip (options.clip), which scaled the returned one by `scale`:
    the same division restores every module's. A per-example clip (DP-SGD) cannot be undone: its norms stay
    those of the gradient returned."""
    scale = _field(clip, "scale")
    if not scale or scale == 1.0:
        return grad_norm, modules
    total = _field(clip, "total_norm")
    return (total if total is not None else grad_norm / scale), {m: v / scale for m, v in modules.items()}


def _kept_weights(request: GradientRequest, names: list[str], bounds: RunBounds) -> dict[str, Tensor]:
    weights = request.model.weights or {}
    kept = {n: weights[n] for n in names if n in weights}
    size = sum(ITEMSIZE.get(t.dtype, 8) * math.prod(t.shape) for t in kept.values())
    return kept if size <= bounds.weights_max_bytes else {}


def step_of(request: GradientRequest, result: GradientResult, job_id: str,
            previous: bytes | None, bounds: RunBounds) -> tuple[RunStep, bytes]:
    """The step to record and the weights to keep for the next one (b"": none)."""
    grads = {n: _flat(g, n) for n, g in result.gradients.items() if g is not None}
    grad_norm, module_norms = _before_clipping(*gradient_norms(grads), _field(result, "clip"))
    kept = _kept_weights(request, list(result.gradients), bounds)
    current = {n: _flat(t, n) for n, t in kept.items()}
    ratios = None
    if previous and current:
        before = {n: _flat(t, n) for n, t in _weights_decoder.decode(previous).items()}
        ratios = update_ratios(before, current) or None
    noise_scale, clip = _extras(result)
    nc = result.numcheck
    step = RunStep(step=request.run.step or 0, job_id=job_id, ended_at=datetime.now(timezone.utc).isoformat(),
                   loss=result.loss, losses=result.losses, grad_norm=grad_norm, module_grad_norms=module_norms,
                   update_ratio=ratios, noise_scale=noise_scale, clip=clip, total_ms=result.timings.total_ms,
                   numcheck=None if nc is None else RunCheck(nc.mode, nc.passed, nc.max_rel_error))
    return step, _weights_encoder.encode({n: _as_raw(t, current[n]) for n, t in kept.items()}) if kept else b""


def _as_raw(t: Tensor, flat: np.ndarray) -> Tensor:
    """A weight as raw bytes in its own dtype (what the next step reads fastest), whatever form the body gave."""
    if raw_data(t) is not None or t.dtype not in _NUMPY:
        return Tensor(dtype=t.dtype, shape=t.shape, data=t.data, b64=t.b64)
    return Tensor(dtype=t.dtype, shape=t.shape, data=flat.astype(_NUMPY[t.dtype]).tobytes())


class StepRecorder:
    """A run's step for one job: the previous step's weights, read from Redis before the job computes (read on
    a thread to overlap the computation measured no better on a loaded 2-core host, bench/runs.py), then finish()
    computes the step and returns the write that records it, for the job's success transaction."""

    def __init__(self, connection, prefix: str, bounds: RunBounds, owner: str, job_id: str,
                 request: GradientRequest) -> None:
        self.store = RunStore(connection, prefix, bounds)
        self.owner, self.job_id, self.request = owner, job_id, request
        self.previous = self.store.previous_weights(owner, request.run.name)

    def finish(self, result: GradientResult) -> Callable[[Any], None]:
        run, store = self.request.run, self.store
        step, weights = step_of(self.request, result, self.job_id, self.previous, store.bounds)
        return lambda client: store.record(client, self.owner, self.job_id, step, run.name, run.step is not None,
                                           weights)
