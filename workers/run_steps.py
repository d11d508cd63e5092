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
from typing import Any

import msgspec
import torch

from gradsvc.broker.runs import RunBounds, RunStore
from gradsvc.engine import tensors
from gradsvc.wire import (
    ITEMSIZE,
    GradientRequest,
    GradientResult,
    RunCheck,
    RunStep,
    Tensor,
)

_weights_encoder = msgspec.msgpack.Encoder()
_weights_decoder = msgspec.msgpack.Decoder(dict[str, Tensor])
_ANY_SIZE = 1 << 62  # decode's element bound: these tensors were bounded when the job decoded them


def module_of(name: str) -> str:
    """A parameter's module: its parent path; a parameter of the root module is a module of its own."""
    parent, _, _ = name.rpartition(".")
    return parent or name


def _decoded(t: Tensor, name: str) -> torch.Tensor:
    return tensors.decode(t, where=name, max_elements=_ANY_SIZE)


def gradient_norms(gradients: dict[str, torch.Tensor]) -> tuple[float, dict[str, float]]:
    """The global L2 norm and each module's (over the parameters under its path), accumulated in float64."""
    names = list(gradients)
    norms = torch._foreach_norm([gradients[n].double() for n in names]) if names else []
    squares: dict[str, float] = {}
    for name, norm in zip(names, norms):
        module = module_of(name)
        squares[module] = squares.get(module, 0.0) + float(norm) ** 2
    return math.sqrt(sum(squares.values())), {m: math.sqrt(s) for m, s in squares.items()}


def update_ratios(previous: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> dict[str, float]:
    """|w_t - w_(t-1)| / |w_(t-1)| per module, over the parameters both steps carry with the same shape."""
    names = [n for n, w in current.items() if n in previous and previous[n].shape == w.shape]
    if not names:
        return {}
    before = [previous[n].double() for n in names]
    moved = torch._foreach_norm(torch._foreach_sub([current[n].double() for n in names], before))
    sizes = torch._foreach_norm(before)
    diff: dict[str, float] = {}
    base: dict[str, float] = {}
    for name, d, b in zip(names, moved, sizes):
        module = module_of(name)
        diff[module] = diff.get(module, 0.0) + float(d) ** 2
        base[module] = base.get(module, 0.0) + float(b) ** 2
    return {m: math.sqrt(diff[m] / base[m]) for m in diff if base[m] > 0}


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


def _kept_weights(request: GradientRequest, names: list[str], bounds: RunBounds) -> dict[str, Tensor]:
    weights = request.model.weights or {}
    kept = {n: weights[n] for n in names if n in weights}
    size = sum(ITEMSIZE.get(t.dtype, 8) * math.prod(t.shape) for t in kept.values())
    return kept if size <= bounds.weights_max_bytes else {}


def step_of(request: GradientRequest, result: GradientResult, job_id: str,
            previous: bytes | None, bounds: RunBounds) -> tuple[RunStep, bytes]:
    """The step to record and the weights to keep for the next one (b"": none)."""
    grads = {n: _decoded(g, n) for n, g in result.gradients.items() if g is not None}
    grad_norm, module_norms = gradient_norms(grads)
    kept = _kept_weights(request, list(result.gradients), bounds)
    ratios = None
    if previous and kept:
        before = {n: _decoded(t, n) for n, t in _weights_decoder.decode(previous).items()}
        ratios = update_ratios(before, {n: _decoded(t, n) for n, t in kept.items()}) or None
    noise_scale, clip = _extras(result)
    nc = result.numcheck
    step = RunStep(step=request.run.step or 0, job_id=job_id, ended_at=datetime.now(timezone.utc).isoformat(),
                   loss=result.loss, losses=result.losses, grad_norm=grad_norm, module_grad_norms=module_norms,
                   update_ratio=ratios, noise_scale=noise_scale, clip=clip, total_ms=result.timings.total_ms,
                   numcheck=None if nc is None else RunCheck(nc.mode, nc.passed, nc.max_rel_error))
    return step, _weights_encoder.encode(kept) if kept else b""


def prepare_step(connection, prefix: str, bounds: RunBounds, owner: str, job_id: str,
                 request: GradientRequest, result: GradientResult):
    """The run's step computed now (one Redis read: the previous weights), returned as the write that records
    it, for the job's success transaction."""
    run = request.run
    store = RunStore(connection, prefix, bounds)
    step, weights = step_of(request, result, job_id, store.previous_weights(owner, run.name), bounds)
    return lambda client: store.record(client, owner, job_id, step, run.name, run.step is not None, weights)
