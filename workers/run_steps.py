"""A run's step as the worker records it (docs/runs.md): the L2 norms of the returned gradients (global and per
module), the update ratio per module against the run's previous step's weights, the loss and the check in
brief; written by the job's success transaction (gradsvc/broker/runs.py), so a step exists once its job finished.

The update ratio needs w_(t-1) when step t arrives, on whichever worker takes it: the run keeps the previous
step's weights in Redis (one vector of what the request carried, exact in the widest of its dtypes, after a
16-byte token that names them), replaced at each step. Norms alone cannot give |w_t - w_(t-1)|, and a sketch
would only approximate it; weights sent by reference could be kept as their refs, but the SDK sends the weights
a loop changes in the body, so the values are what there is. A model larger than GRADSVC_RUN_WEIGHTS_MAX_BYTES keeps none and records no ratio.

What a step costs the job (bench/runs.py): the read of the previous weights is sent as the job starts, on a
connection of its own, and its reply taken after the computation, so its round trip overlaps the job's. A worker
keeps the weights of the steps it recorded in its LRU (float64, module by module, with their token): when the
token in Redis is still that one, nothing is decoded, and the read is the token alone (GETRANGE); when another
worker recorded a step since, the Redis copy is read after (a second round trip), and the run's next step on
this worker reads the weights whole in flight (a run that workers take in turn). The norms and ratios are one
numpy pass over all the tensors, in float64."""

from __future__ import annotations

import base64
import math
import os
from datetime import datetime, timezone
from typing import Any, Callable, NamedTuple

import msgspec
import numpy as np

from gradsvc.broker import keys
from gradsvc.broker.runs import RunBounds, RunStore
from gradsvc.engine import tensors
from gradsvc.lru import LRU
from gradsvc.wire import ITEMSIZE, GradientRequest, GradientResult, RunCheck, RunStep, Tensor, raw_data

_weights_decoder = msgspec.msgpack.Decoder(dict[str, Tensor])  # the kept weights of an older version
_ANY_SIZE = 1 << 62  # decode's element bound: these tensors were bounded when the job decoded them

# The token before a run's kept weights in Redis: "W" and 15 random bytes. The weights of an older version were
# the MessagePack map alone, which never starts with "W" (0x57 would be an integer), so both read.
TOKEN_SIZE = 16
_TOKEN_MARK = b"W"

# A worker's kept weights (weights_cache): runs stepping on it at once, and the float64 copies' bytes (twice the
# default GRADSVC_RUN_WEIGHTS_MAX_BYTES: a float32 model at that bound); a larger model's are read from Redis.
KEPT_RUNS = 16
KEPT_BYTES = 128 << 20


def module_of(name: str) -> str:
    """A parameter's module: its parent path; a parameter of the root module is a module of its own."""
    parent, _, _ = name.rpartition(".")
    return parent or name


# The wire dtypes numpy reads from raw little-endian bytes; others (bfloat16) go through torch.
_NUMPY = {"float64": "<f8", "float32": "<f4", "float16": "<f2"}


def _array(t: Tensor, name: str) -> np.ndarray:
    """A wire tensor's elements as a 1-D array: a view of its raw bytes in their own dtype where numpy reads them
    (flat_of converts once, to float64, for all tensors together). numpy, not torch: a step's tensors are a small
    job's few small ones, where torch's per-call overhead (~20 us) would be most of the recording's cost."""
    raw = raw_data(t)
    if raw is not None and t.dtype in _NUMPY:
        return np.frombuffer(raw, dtype=_NUMPY[t.dtype])
    if isinstance(t.data, list):
        return np.asarray(t.data, dtype=np.float64).reshape(-1)
    if t.b64 is not None and t.dtype in _NUMPY:  # JSON's raw bytes
        return np.frombuffer(base64.b64decode(t.b64), dtype=_NUMPY[t.dtype])
    return tensors.decode(t, where=name, max_elements=_ANY_SIZE).double().reshape(-1).numpy()


class Flat(NamedTuple):
    """Tensors as one float64 vector, module by module (each module's parameters next to each other, modules
    in the order they first appear): what one numpy pass sums per module."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    modules: tuple[str, ...]
    at: list[int]  # where each module that has elements starts in `vector` (np.add.reduceat's indices)
    filled: list[str]  # those modules
    vector: np.ndarray


def _flat(groups: dict[str, list[str]], sizes: dict[str, int], vector: np.ndarray) -> Flat:
    """The Flat of `vector`, laid out as `groups` (each module's parameter names, in order) says."""
    names, at, filled, offset = [], [], [], 0
    for module, group in groups.items():
        start = offset
        names += group
        offset += sum(sizes[n] for n in group)
        if offset > start:
            at.append(start)
            filled.append(module)
    return Flat(tuple(names), tuple(sizes[n] for n in names), tuple(groups), at, filled, vector)


def _grouped(names) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(module_of(name), []).append(name)
    return groups


def flat_of(arrays: dict[str, np.ndarray]) -> Flat:
    """1-D arrays by parameter name as one Flat."""
    groups = _grouped(arrays)
    parts = [arrays[n] for group in groups.values() for n in group]
    vector = np.concatenate(parts, dtype=np.float64) if parts else np.zeros(0)
    return _flat(groups, {n: a.size for n, a in arrays.items()}, vector)


def module_squares(flat: Flat, values: np.ndarray) -> dict[str, float]:
    """The sum of `values`' squares over each module's part (`values` laid out as flat.vector), in one pass."""
    out = dict.fromkeys(flat.modules, 0.0)
    if flat.at:
        out.update(zip(flat.filled, np.add.reduceat(values * values, flat.at).tolist()))
    return out


def _norms(flat: Flat) -> tuple[float, dict[str, float]]:
    squares = module_squares(flat, flat.vector)
    return math.sqrt(sum(squares.values())), {m: math.sqrt(s) for m, s in squares.items()}


def gradient_norms(gradients: dict[str, np.ndarray]) -> tuple[float, dict[str, float]]:
    """The global L2 norm and each module's (over the parameters under its path), in float64."""
    return _norms(flat_of(gradients))


def _pieces(flat: Flat) -> dict[str, np.ndarray]:
    return dict(zip(flat.names, np.split(flat.vector, np.cumsum(flat.sizes)[:-1])))


def ratios_of(previous: Flat, current: Flat) -> dict[str, float]:
    """|w_t - w_(t-1)| / |w_(t-1)| per module, over the parameters both steps carry with the same size: one
    pass over the two vectors when both carry the same parameters (a training loop's every step)."""
    if previous.names != current.names or previous.sizes != current.sizes:
        before, now = _pieces(previous), _pieces(current)
        names = [n for n, w in now.items() if n in before and before[n].size == w.size]
        previous, current = flat_of({n: before[n] for n in names}), flat_of({n: now[n] for n in names})
    moved = module_squares(current, current.vector - previous.vector)
    base = module_squares(previous, previous.vector)
    return {m: math.sqrt(moved[m] / base[m]) for m in moved if base[m] > 0}


def update_ratios(previous: dict[str, np.ndarray], current: dict[str, np.ndarray]) -> dict[str, float]:
    """|w_t - w_(t-1)| / |w_(t-1)| per module, over the parameters both steps carry with the same size."""
    return ratios_of(flat_of(previous), flat_of(current))


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


class Weights(NamedTuple):
    """What a step keeps for the next one: its weights as one vector, and what Redis holds of them (`stored`)."""

    token: bytes
    flat: Flat
    stored: bytes
    shared: bool = False  # in a worker's cache: another worker recorded a step of the run before this one


class _Stored(msgspec.Struct, array_like=True):
    """A run's kept weights in Redis, after their token: the vector in one dtype, laid out as Flat's."""

    names: list[str]
    sizes: list[int]
    dtype: str  # numpy's: "<f8", "<f4" or "<f2", the widest of the weights' (bfloat16 as float32), so exact
    data: bytes


_stored_encoder = msgspec.msgpack.Encoder()
_stored_decoder = msgspec.msgpack.Decoder(_Stored)


def stored_weights(value: bytes | None) -> Flat | None:
    """The weights Redis keeps for a run (Weights.stored, or an older version's MessagePack map of tensors)."""
    if not value:
        return None
    if value[:1] != _TOKEN_MARK:
        return flat_of({n: _array(t, n) for n, t in _weights_decoder.decode(value).items()})
    kept = _stored_decoder.decode(memoryview(value)[TOKEN_SIZE:])
    vector = np.frombuffer(kept.data, dtype=kept.dtype).astype(np.float64)
    return _flat(_grouped(kept.names), dict(zip(kept.names, kept.sizes)), vector)


def _kept(request: GradientRequest, names: list[str], bounds: RunBounds) -> Weights | None:
    weights = request.model.weights or {}
    kept = {n: weights[n] for n in names if n in weights}
    size = sum(ITEMSIZE.get(t.dtype, 8) * math.prod(t.shape) for t in kept.values())
    if not kept or size > bounds.weights_max_bytes:
        return None
    flat = flat_of({n: _array(t, n) for n, t in kept.items()})
    dtypes = {t.dtype for t in kept.values()}
    dtype = "<f8" if "float64" in dtypes else "<f2" if dtypes == {"float16"} else "<f4"
    token = _TOKEN_MARK + os.urandom(TOKEN_SIZE - 1)
    stored = _Stored(list(flat.names), list(flat.sizes), dtype, flat.vector.astype(dtype, copy=False).tobytes())
    return Weights(token, flat, token + _stored_encoder.encode(stored))


def step_of(request: GradientRequest, result: GradientResult, job_id: str,
            previous: Flat | None, bounds: RunBounds) -> tuple[RunStep, Weights | None]:
    """The step to record and the weights to keep for the next one (None: none)."""
    grads = flat_of({n: _array(g, n) for n, g in result.gradients.items() if g is not None})
    grad_norm, module_norms = _before_clipping(*_norms(grads), _field(result, "clip"))
    kept = _kept(request, list(result.gradients), bounds)
    ratios = (ratios_of(previous, kept.flat) or None) if previous is not None and kept is not None else None
    noise_scale, clip = _extras(result)
    nc = result.numcheck
    step = RunStep(step=request.run.step or 0, job_id=job_id, ended_at=datetime.now(timezone.utc).isoformat(),
                   loss=result.loss, losses=result.losses, grad_norm=grad_norm, module_grad_norms=module_norms,
                   update_ratio=ratios, noise_scale=noise_scale, clip=clip, total_ms=result.timings.total_ms,
                   numcheck=None if nc is None else RunCheck(nc.mode, nc.passed, nc.max_rel_error))
    return step, kept


def weights_cache() -> LRU[Weights]:
    """A worker's kept weights, by (owner, run): the last step each run recorded on it (Weights, less `stored`)."""
    return LRU(KEPT_RUNS, max_bytes=KEPT_BYTES, size=lambda w: w.flat.vector.nbytes)


class _Sent:
    """One command sent now on a connection taken from the client's pool, its reply read later (reply), or
    never (drop: the connection is closed, so no later command reads this reply)."""

    def __init__(self, client, *command) -> None:
        self.pool = client.connection_pool
        self.connection = self.pool.get_connection()
        try:
            self.connection.send_command(*command)
        except BaseException:
            self.drop()
            raise

    def reply(self) -> Any:
        connection, self.connection = self.connection, None
        try:
            return connection.read_response()
        except BaseException:
            connection.disconnect()
            raise
        finally:
            self.pool.release(connection)

    def drop(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.disconnect()
            self.pool.release(connection)


class StepRecorder:
    """A run's step for one job. Made as the job starts: sends the read of the previous step's weights (their
    token alone when this worker's `kept` has them and recorded the step before them too: a run one worker
    steps; a run that several workers step gets the weights read whole and compared by their token); finish() takes the reply after the computation, computes
    the step and returns the write that records it, for the job's success transaction. A job that fails calls
    abandon() instead."""

    def __init__(self, connection, prefix: str, bounds: RunBounds, owner: str, job_id: str,
                 request: GradientRequest, kept: LRU[Weights] | None = None) -> None:
        self.store = RunStore(connection, prefix, bounds)
        self.owner, self.job_id, self.request, self.kept = owner, job_id, request, kept
        self.cached = kept.get((owner, request.run.name)) if kept is not None else None
        self.shared = False  # the previous step was another worker's
        key = keys.run_key(prefix, owner, request.run.name, "weights")
        # A run this worker alone steps: its token; one that other workers step too: the weights themselves
        self.probe = self.cached is not None and not self.cached.shared
        self.read = (_Sent(connection, "GETRANGE", key, 0, TOKEN_SIZE - 1) if self.probe
                     else _Sent(connection, "GET", key))

    def previous(self) -> Flat | None:
        """The previous step's weights: this worker's copy while Redis holds its token, else Redis's."""
        value = self.read.reply()
        if self.cached is None or not value:
            return stored_weights(value)
        if value[:TOKEN_SIZE] == self.cached.token:
            return self.cached.flat
        self.shared = True
        if self.probe:  # the token alone: read the weights another worker recorded since
            value = self.store.previous_weights(self.owner, self.request.run.name)
        return stored_weights(value)

    def abandon(self) -> None:
        self.read.drop()

    def finish(self, result: GradientResult) -> Callable[[Any], None]:
        run, store = self.request.run, self.store
        step, weights = step_of(self.request, result, self.job_id, self.previous(), store.bounds)
        if self.kept is not None:  # a transaction that does not record them leaves another token in Redis
            if weights is None:
                self.kept.pop((self.owner, run.name))
            else:
                self.kept.put((self.owner, run.name), weights._replace(stored=b"", shared=self.shared))
        stored = b"" if weights is None else weights.stored
        return lambda client: store.record(client, self.owner, self.job_id, step, run.name, run.step is not None,
                                           stored)
