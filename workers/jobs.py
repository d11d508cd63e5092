"""The RQ job function: request bytes in, result bytes stored in Redis, failures as coded errors.

The worker's state (WorkerContext: settings, engine, device, metrics, Redis stores, handoff, reaper thread) is
made once by the process entry (workers/main.py, `gradsvc worker`) and handed to each job by the worker that
runs it (GradientWorker.execute_job, hand_over); run_job reads it from the job RQ runs. A job taken by a worker
that has none (a plain `rq worker`) fails `internal_error`, saying to start workers with `gradsvc worker`:
nothing is built from the environment on a first job."""

from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import torch
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import get_current_job
from rq.job import Job
from rq.timeouts import JobTimeoutException

from gradsvc.broker import affinity
from gradsvc.broker import handoff as handoff_files
from gradsvc.broker import keys
from gradsvc.broker.blobs import BlobError, BlobStore
from gradsvc.broker.graphs import GraphStore
from gradsvc.broker.handoff import Handoff, HandoffError
from gradsvc.broker.job import GradientJob
from gradsvc.broker.record import JobMeta, write_error, write_progress
from gradsvc.broker.runs import RunBounds
from gradsvc.engine import ComputeError, Engine, EngineError, SpecError, config_from_settings, resolve_device
from gradsvc.lru import LRU
from gradsvc.runtime.settings import Settings
from gradsvc.wire import GradientRequest, GradientResult

from .metrics import WorkerMetrics
from .run_steps import StepRecorder, weights_cache
from .session_host import SessionHost

log = logging.getLogger("gradsvc.worker")
_result_encoder = msgspec.msgpack.Encoder()
_json_request = msgspec.json.Decoder(GradientRequest)
_msgpack_request = msgspec.msgpack.Decoder(GradientRequest)


class RecordedFailureError(Exception):
    """Raised out of the job function so RQ records the failure; the code is in the job's meta (gradsvc/broker/record.py)."""


class JobCanceledError(Exception):
    """POST /jobs/{id}/cancel asked a running job to stop."""


class ResultBuffer:
    """The buffer a worker encodes each result into, kept from one job to the next: a result of megabytes
    encoded into fresh memory faults its pages in one by one (12.6 MB: 3 ms, up to 20 ms when the VM is short
    of free pages), into memory used before ~1 ms. What is stored is copied out of it (a handoff file, or the
    bytes Redis gets) before release(); past KEEP_MAX a buffer is dropped after its job."""

    KEEP_MAX = 256 << 20

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.view: memoryview | None = None
        self.size = 0

    def encode(self, result: GradientResult) -> memoryview:
        try:
            _result_encoder.encode_into(result, self.buffer)
        except BufferError:  # a view of the last result outlived its job (an error's traceback): leave it be
            self.buffer = bytearray()
            _result_encoder.encode_into(result, self.buffer)
        self.view = memoryview(self.buffer)
        self.size = len(self.view)
        return self.view

    def release(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        if len(self.buffer) > self.KEEP_MAX:
            self.buffer = bytearray()


def _reaper() -> ThreadPoolExecutor:
    """A job's handoff maps, dropped on a thread of their own after the job (run_job). A body mapped from its
    file (unlinked already) is unmapped when its last reference goes, and that frees the file's tmpfs pages:
    3.7 ms for 12.7 MB on a 2-core VM, which would otherwise come between the result and the answer. The job
    hands its maps over once nothing of the request references them; the thread's clear() then drops the last
    reference, and munmap releases the GIL. The thread starts with the first job that hands any over."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsvc-reaper")


@dataclass
class WorkerContext:
    """One worker process's state, made by make_context and ended by close()."""

    settings: Settings
    engine: Engine  # the engine's config and caches, for every job of this worker
    device: torch.device
    metrics: WorkerMetrics
    graphs: GraphStore  # model.graph_ref look-ups, over the worker's Redis connection
    pieces: BlobStore  # tensors by reference, with this worker's LRU of the pieces it used
    handoff: Handoff | None = None  # GRADSVC_HANDOFF_DIR: bodies and results as files (gradsvc/broker/handoff.py)
    results: ResultBuffer = field(default_factory=ResultBuffer)
    reaper: ThreadPoolExecutor = field(default_factory=_reaper)
    taken: list = field(default_factory=list)  # the job's handoff maps, dropped on the reaper once it is done
    spare: handoff_files.Spare | None = None  # tmpfs pages kept for the next result's file (made on the reaper)
    spare_size: int = 0  # the size of the result file the job wrote: its next spare's
    run_weights: LRU = field(default_factory=weights_cache)  # the last step's weights of the runs stepped here
    sessions: SessionHost = field(default_factory=lambda: SessionHost(16))  # the training sessions held here
    holders: LRU = field(default_factory=lambda: LRU(4096))  # (owner, model key) -> when recorded as its holder
    combining: object = None  # workers/combining.py's Combining (a worker that takes several jobs), else None

    def __post_init__(self) -> None:
        if self.handoff is not None and self.spare is None:
            self.spare = handoff_files.Spare(self.handoff)

    def host_held_bytes(self) -> int:
        """The bytes this worker keeps in host memory on purpose: the pieces it caches and, on a CPU, its resident
        models and training sessions (what MemoryKeeper does not count as a job's leftovers)."""
        held = self.pieces.cache.bytes
        if self.device.type == "cpu":
            held += self.engine.caches.resident_models.bytes + self.sessions.held_bytes
        return held

    def refresh_graphs(self) -> None:
        """The graph TTL refreshes the job's graph_ref look-ups left due (GraphStore, deferred), sent on the
        reaper thread after the job: no round trip on the job's path (the worker calls it after each job)."""
        if self.graphs.pending():
            self.reaper.submit(_refresh_graphs, self.graphs)

    def close(self) -> None:
        """The worker's exit: its spare result file deleted (a prepare still running on the reaper then keeps
        none: Spare.drop), the graph refreshes due sent, the reaper's work done and its thread ended, the
        handoff's writer threads too."""
        if self.spare is not None:
            self.spare.drop()
        self.refresh_graphs()
        self.reaper.shutdown(wait=True)
        if self.handoff is not None:
            self.handoff.close()


def _refresh_graphs(graphs: GraphStore) -> None:
    try:
        graphs.refresh_due()
    except RedisError as exc:  # kept due: the next job's refresh sends them again
        log.warning("graph TTL refresh failed, Redis unreachable or refusing writes (%s); retried after the next "
                    "job", exc)


def _owner(job: Job) -> str:
    return JobMeta.of(job.meta).job_owner


def _graphs(ctx: WorkerContext, job: Job):
    """model.graph_ref resolved among the graphs of the job's owner."""
    return ctx.graphs.resolver(_owner(job))


def _with_pieces(ctx: WorkerContext, job: Job, request: GradientRequest, in_place: bool = True,
                 keep: set[str] | frozenset = frozenset()) -> GradientRequest:
    """The request with its tensors by reference filled in, from this worker's LRU or the owner's pieces; the
    weights a model this worker holds for the owner has in place stay refs alone (never fetched: resident.py),
    unless `in_place` is False (a training session builds a model of its own): then those named in `keep` (the
    frozen weights its sessions share, engine/frozen.py) stay refs alone."""
    try:
        held = ctx.engine.in_place(request, ctx.device, _owner(job)) if in_place else keep
        resolved = ctx.pieces.resolved(_owner(job), request, held)
    except BlobError as exc:
        raise SpecError(exc.code, exc.message, **exc.detail) from None
    ctx.metrics.observe_tensor_cache(ctx.pieces.cache)
    return resolved


def _record_holder(ctx: WorkerContext, job: Job, request: GradientRequest, result: GradientResult) -> None:
    """Records this worker as the holder of the job's model (gradsvc/broker/affinity.py), so the owner's next job of
    it comes to this worker's own queue: once per model until half the record's TTL has passed."""
    owner, key = _owner(job), affinity.model_key(request, result.graph_ref)
    now = time.monotonic()
    last = ctx.holders.get((owner, key))
    if last is not None and now - last < affinity.HOLDER_TTL_S / 2:
        return
    try:
        affinity.record_holder(job.connection, ctx.settings.queue_prefix, owner, key, job.worker_name,
                               affinity.HOLDER_TTL_S)
    except (RedisConnectionError, RedisTimeoutError):
        return  # advisory: the next job of the model records it
    ctx.holders.put((owner, key), now)


def make_context(settings: Settings, connection: Redis) -> WorkerContext:
    """The worker process's state, made once by its entry (workers/main.py): `connection` is the worker's own
    Redis client, the one RQ gives its jobs and their callbacks."""
    device = resolve_device(settings.worker_device)
    if device.type == "cpu" and settings.workers > 1:
        # N CPU workers on one machine share its cores: with every worker at the default (all cores),
        # idle OpenMP threads spin on cores a sibling needs (bench/throughput.py: 2 workers ran slower
        # than 1 on 2 cores).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.workers))
    handoff = handoff_files.open_dir(settings.handoff_dir, settings.handoff_min_bytes)
    handoff_files.bind(connection, handoff)  # for RQ's failure callbacks (gradsvc.broker.fanin.shard_failed)
    s = settings
    return WorkerContext(settings=settings, engine=Engine(config_from_settings(settings, device)), device=device,
                         metrics=WorkerMetrics(), graphs=GraphStore(connection, s.queue_prefix, s.graph_ttl_s, deferred=True),
                         pieces=BlobStore(connection, s.queue_prefix, s.tensor_ttl_s, s.tensor_budget_bytes,
                                          cache_bytes=s.tensor_cache_bytes),
                         handoff=handoff, sessions=SessionHost(s.session_max_per_worker))


# The attribute of a job that holds the context of the worker running it (hand_over, context_of).
_CONTEXT = "gradsvc_context"


def hand_over(job: Job, ctx: WorkerContext | None) -> None:
    """Gives the job the context of the worker about to run it (GradientWorker.execute_job)."""
    setattr(job, _CONTEXT, ctx)


def context_of(job: Job) -> WorkerContext:
    """The context the job's worker handed it; a job run by a worker that has none (a plain `rq worker`, or a
    GradientWorker built without one) is failed as a coded error saying how workers are started."""
    ctx = getattr(job, _CONTEXT, None)
    if ctx is None:
        message = ("this job was taken by a worker that gradsvc did not start (a plain `rq worker`, or a "
                   "GradientWorker made without its context), which has no device, engine or handoff dir set up for "
                   "it; start workers with `gradsvc worker` (or `gradsvc up`) and submit the job again")
        write_error(job, "internal_error", message)
        raise RecordedFailureError(f"internal_error: {message}")
    return ctx


def decode_request(body: "bytes | mmap.mmap", fmt: str) -> GradientRequest:
    try:
        return (_msgpack_request if fmt == "msgpack" else _json_request).decode(body)
    except msgspec.ValidationError as exc:
        raise SpecError("invalid_body", f"the request does not match the schema: {exc}") from None
    except msgspec.DecodeError as exc:
        raise SpecError("malformed_body", f"the request body is not valid {fmt}: {exc}") from None


class _ProgressReporter:
    """Writes {phase, done, total} into the job's meta and polls the cancel flag, each at most a few times a second.
    A shard polls its parent job's flag (`cancel_id`): DELETE, or a failed sibling, stops every shard."""

    def __init__(self, job: Job, prefix: str, cancel_id: str | None = None) -> None:
        self.job = job
        self.cancel_key = keys.cancel_key(prefix, cancel_id or job.id)
        # The clocks start with the job: one that ends within 0.2 s writes no progress and polls nothing
        # (its status says it all), sparing a small job three Redis round trips (bench/small_job.py).
        self.started = self.last_save = self.last_poll = time.monotonic()

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        try:
            if now - self.last_poll > 0.2:
                self.last_poll = now
                if self.job.connection.exists(self.cancel_key):
                    raise JobCanceledError()
            if now - self.last_save > 0.5 or (done == total and now - self.started > 0.2):
                self.last_save = now
                write_progress(self.job, phase, done, total)
        except (RedisConnectionError, RedisTimeoutError):
            pass  # progress is advisory: a Redis blip must not fail the computation


def _fail(job: Job, ctx: WorkerContext, code: str, message: str, detail: dict | None = None,
          kind: str = "job") -> RecordedFailureError:
    write_error(job, code, message, detail)
    ctx.metrics.observe_failure(str(ctx.device), code, kind=kind)
    return RecordedFailureError(f"{code}: {message}")


def job_input(job: Job, ctx: WorkerContext, body: bytes | str, cancel_id: str | None = None) -> "bytes | mmap.mmap":
    """The request's bytes: the job's argument itself, or the file a handoff ref names (mapped, then deleted).
    A ref is never a path: gradsvc/broker/handoff.py checks its domain and name and joins it to this worker's dir."""
    if not isinstance(body, str):
        return body
    if ctx.handoff is None:
        raise ComputeError("input_lost", "the job's body was handed over as a file (GRADSVC_HANDOFF_DIR) but this "
                           "worker has no handoff dir, so it cannot read it; submit the job again", ref=body[:100])
    try:
        data = ctx.handoff.take(body)
    except HandoffError as exc:
        raise ComputeError("input_lost", f"the job's body cannot be read here: {exc}; submit the job again",
                           ref=body[:100]) from None
    if data:
        ctx.taken.append(data)
    if data is None:
        if job.connection.exists(keys.cancel_key(ctx.settings.queue_prefix, cancel_id or job.id)):
            raise JobCanceledError()  # DELETE deleted it as this worker took the job
        raise ComputeError("input_lost", "the job's body, handed over as a file in GRADSVC_HANDOFF_DIR, was gone when "
                           "a worker took the job (it waited longer than GRADSVC_FAILURE_TTL_S, was canceled, or "
                           "the dir was cleared); submit the job again", ref=body[:100])
    return data


def stored_value(job: Job, ctx: WorkerContext, kind: str, data: bytes | memoryview) -> bytes:
    """What a result key (or a shard's reference key) holds for `data`: the bytes themselves, or, for a large
    one of a job that came through this worker's handoff domain, the marker of the file they went to. `data`
    may be a view of a buffer the worker reuses: what is returned is the worker's to keep."""
    handoff = ctx.handoff
    if handoff is not None and handoff.wanted(len(data)) and keys.in_domain(job.origin, handoff.domain):
        try:
            ref = handoff.put(job.id, kind, data, spare=ctx.spare)
            ctx.spare_size = len(data)
            return handoff.marker(ref)
        except OSError as exc:  # the tmpfs is full: Redis still takes it
            log.warning("job %s: handoff of %d bytes failed (%s); storing them in Redis", job.id, len(data), exc)
    return bytes(data)


def store_value(job: Job, ctx: WorkerContext, key: str, kind: str, data: bytes) -> None:
    """SET of stored_value() for GRADSVC_RESULT_TTL_S."""
    job.connection.set(key, stored_value(job, ctx, kind, data), ex=ctx.settings.result_ttl_s)


def sweep_handoff(ctx: WorkerContext) -> None:
    """At most once a minute: delete the handoff files that outlived their TTL (gradsvc.broker.handoff.sweep_ages)."""
    handoff = ctx.handoff
    if handoff is None or not handoff.sweep_due():
        return
    try:
        handoff.sweep(handoff_files.sweep_ages(ctx.settings.result_ttl_s, ctx.settings.failure_ttl_s))
    except OSError as exc:
        log.warning("handoff sweep of %s failed: %s", handoff.dir, exc)


def gradient_job(body: bytes | str, fmt: str) -> dict:
    """Computes one POST /gradients request; the result goes to its own key as MessagePack. `body`: the
    request's bytes, or a handoff ref (str) naming the file that holds them."""
    return run_job(lambda job, ctx, queue_s: compute_request(job, ctx, body, fmt, queue_s) if ctx.combining is None
                   else ctx.combining.compute(job, ctx, body, fmt, queue_s))


def compute_request(job: Job, ctx: WorkerContext, body: bytes | str, fmt: str, queue_s: float,
                    cancel_id: str | None = None, reference: dict | None = None) -> GradientResult:
    request = _with_pieces(ctx, job, decode_request(job_input(job, ctx, body, cancel_id), fmt))
    recorder = None
    if request.run is not None and cancel_id is None:  # a shard is no step: the API refuses runs with shards
        s = ctx.settings
        recorder = StepRecorder(job.connection, s.queue_prefix, RunBounds.from_settings(s), _owner(job), job.id,
                                request, ctx.run_weights)
    try:
        result = ctx.engine.compute(request, progress=_ProgressReporter(job, ctx.settings.queue_prefix, cancel_id),
                                    device=ctx.device, graphs=_graphs(ctx, job), reference=reference,
                                    scope=_owner(job))
    except BaseException:
        if recorder is not None:
            recorder.abandon()  # its read of the previous weights is in flight: its connection is closed
        raise
    result.timings.queue_ms = 1e3 * queue_s
    ctx.metrics.observe_resident(ctx.engine.caches.resident_models)
    if result.prepared is not None and cancel_id is None:
        _record_holder(ctx, job, request, result)
    if recorder is not None:
        job.pending_step = recorder.finish(result)
    return result


def run_job(work: Callable[[Job, WorkerContext, float], GradientResult], kind: str = "job") -> dict:
    """Runs `work` as the current RQ job: stores its result under the job's result key, records a failure
    as a coded error in job.meta, and observes the worker's metrics (`kind`: job, shard or reduce)."""
    job = get_current_job()
    assert job is not None, "gradient jobs run inside an RQ worker"
    ctx = context_of(job)
    settings = ctx.settings
    queue_s = (job.started_at - job.enqueued_at).total_seconds() if job.started_at and job.enqueued_at else 0.0
    ctx.metrics.busy.set(1)
    try:
        result = work(job, ctx, queue_s)
        result.job_id = job.id
        data = ctx.results.encode(result)
        if len(data) > settings.max_result_bytes:
            raise ComputeError("result_too_large", f"the result takes {len(data)} bytes, above the limit of "
                               f"{settings.max_result_bytes}; ask for fewer outputs (per_sample='norms', "
                               "no per_loss) or a smaller model", result_bytes=len(data),
                               limit=settings.max_result_bytes)
        result_key = keys.result_key(settings.queue_prefix, job.id)
        if isinstance(job, GradientJob):  # written in RQ's success transaction (GradientJob._handle_success)
            job.pending_result = (result_key, stored_value(job, ctx, handoff_files.RESULT, data),
                                  settings.result_ttl_s)
        else:
            store_value(job, ctx, result_key, handoff_files.RESULT, data)
            if getattr(job, "pending_step", None) is not None:
                job.pending_step(job.connection)
    except EngineError as exc:
        raise _fail(job, ctx, exc.code, exc.message, exc.detail, kind) from None
    except JobCanceledError:
        raise _fail(job, ctx, "canceled", "the job was canceled by POST /jobs/{id}/cancel while running",
                    kind=kind) from None
    except JobTimeoutException:
        raise _fail(job, ctx, "timeout", f"the job ran past its timeout of {job.timeout} s; use a smaller model, "
                    "numcheck='directional' or 'off', or fewer timing repeats", kind=kind) from None
    except (RedisConnectionError, RedisTimeoutError):
        raise  # Redis is gone: nothing can be recorded now; the lapsed lease reports the job as worker_lost
    except Exception as exc:  # a bug, not the user's input: report it as such and keep the worker alive
        log.exception("job %s failed unexpectedly", job.id)
        raise _fail(job, ctx, "internal_error", f"the worker failed unexpectedly ({type(exc).__name__}); "
                    "this is a gradsvc bug, please report it with the request", kind=kind) from None
    finally:
        ctx.results.release()
        ctx.metrics.busy.set(0)
        sweep_handoff(ctx)
        if ctx.taken:
            ctx.reaper.submit(ctx.taken.clear)
            ctx.taken = []
        if ctx.spare_size and ctx.spare is not None:  # after the body's pages are freed: these may be them
            ctx.reaper.submit(ctx.spare.prepare, ctx.spare_size)
            ctx.spare_size = 0
    size = ctx.results.size
    device = str(ctx.device) if kind == "reduce" else result.device  # a reduced result may name several devices
    ctx.metrics.observe_result(device, result.timings, result.memory, result.numcheck, queue_s, kind=kind)
    return {"result_bytes": size}
