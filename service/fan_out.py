"""One request over many workers (options.shards): the batch split into contiguous row ranges, one
RQ job per shard (an RQ Group), and a reduce job with a Dependency on all of them.

The caller sees one job: the reduce job. Its id is the job id, its meta holds the owner and the
shard ids, its result key holds the combined result, and its RQ results stream is what a waiting
POST blocks on; while it is deferred, GET /jobs/{id} reads its status and progress from the shards.
Each shard is a normal GradientRequest over its rows (MessagePack, inputs and targets sliced as wire
tensors, never decoded here), computed by any worker as any job is, its result under its own
result key, which only the reduce job reads. A shard that fails fails the job (workers/shards.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import msgspec
from rq import Queue
from rq.callbacks import Callback
from rq.group import Group
from rq.job import Dependency, JobStatus
from rq.utils import now

from gradsvc.broker import handoff as handoff_files
from gradsvc.broker.fanin import shard_failed, shard_job_id
from gradsvc.broker.handoff import Handoff
from gradsvc.broker.job import REDUCE_JOB, SHARD_JOB
from gradsvc.broker.record import JobMeta, ShardPlace
from gradsvc.engine.diagnostics import sharded as sharded_curvature
from gradsvc.engine.prepare import Prepared
from gradsvc.engine.reduce import ShardPlan, validate_shardable, plan_for, split_rows
from gradsvc.wire import ITEMSIZE, MAX_SHARDS, GradientRequest, Tensor, is_tensor, raw_data

from . import recent
from .exceptions import ServiceError
from .queues import JobRecord

_encoder = msgspec.msgpack.Encoder()


def shard_count(option: int | str, rows: int, live_workers: Callable[[], int], min_rows: int) -> int:
    """The number of shards options.shards asks for; "auto" is one per live worker of the device, each
    of at least min_rows rows (so a small batch is not split at all)."""
    if option == "auto":
        return max(1, min(live_workers(), rows // min_rows, MAX_SHARDS))
    return option  # an integer in [1, MAX_SHARDS]: the schema refused any other at decode (400 invalid_body)


# --- slicing wire values by rows, without torch -----------------------------------------------------------
def _slice_tensor(t: Tensor, a: int, b: int) -> Tensor:
    if t.data is None and t.b64 is None:
        # Its bytes are pieces in Redis, cut where the uploader cut them, not at rows: the API holds no bytes
        # to slice, and fetching them here would put the whole batch through the API's memory.
        raise ServiceError("bad_option", "options.shards splits the batch by rows, and a batched input or target "
                           "here is sent by reference (refs), whose pieces cannot be split by rows; send the batched "
                           "inputs and targets inline ('data' or 'b64'; weights may stay by reference), or set "
                           "options.shards to 1", option="shards")
    shape = [b - a, *t.shape[1:]]
    if t.b64 is not None or raw_data(t) is not None:
        import base64

        raw = memoryview(base64.b64decode(t.b64) if t.b64 is not None else t.data)  # a view: no copy here
        row_bytes = math.prod(t.shape[1:]) * ITEMSIZE[t.dtype]
        return Tensor(dtype=t.dtype, shape=shape, data=raw[a * row_bytes:b * row_bytes])
    return Tensor(dtype=t.dtype, shape=shape, data=t.data[a:b])


def slice_rows(value: Any, a: int, b: int) -> Any:
    """Rows a:b of a wire tensor (raw bytes, base64 or nested lists) or a bare nested list."""
    if isinstance(value, Tensor):
        return _slice_tensor(value, a, b)
    if isinstance(value, dict):  # a tensor inside `targets` (typed Any) arrives as a plain dict
        return _slice_tensor(msgspec.convert(value, Tensor), a, b)
    return value[a:b]


def _slice_targets(req: GradientRequest, prep: Prepared, a: int, b: int) -> Any:
    targets = req.targets
    k = prep.rows_per_example or 1  # validate_shardable refused a model whose output rows do not map
    if isinstance(targets, dict) and not is_tensor(targets):
        used = {t.target or t.name for t in prep.terms}  # the engine reads no other entry
        return {name: slice_rows(v, a * k, b * k) for name, v in targets.items() if name in used}
    return slice_rows(targets, a * k, b * k)


def _slice_inputs(req: GradientRequest, prep: Prepared, a: int, b: int) -> Any:
    """Rows a:b of every batched input, in the form the request gave them (one, a list, an object)."""
    inputs, batch = req.inputs, prep.inputs
    if isinstance(inputs, dict) and not is_tensor(inputs):
        batched = dict(zip(batch.names, batch.batched))
        return {name: slice_rows(v, a, b) if batched[name] else v for name, v in inputs.items()}
    if isinstance(inputs, list) and len(batch.names) > 1:
        return [slice_rows(v, a, b) if is_batched else v for v, is_batched in zip(inputs, batch.batched)]
    return slice_rows(inputs, a, b)


def shard_requests(req: GradientRequest, prep: Prepared, bounds: list[tuple[int, int]],
                   *, per_loss: bool | None) -> list[GradientRequest]:
    """One normal request per shard: the same model, losses and options over rows a:b."""
    options = msgspec.structs.replace(req.options, shards=1, per_loss=per_loss)
    return [msgspec.structs.replace(req, inputs=_slice_inputs(req, prep, a, b),
                                    targets=_slice_targets(req, prep, a, b), options=options)
            for a, b in bounds]


# --- the fan-out ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Split:
    """A request cut into shards: the reduction's plan, each shard's rows a:b and its MessagePack body."""

    plan: ShardPlan
    bounds: list[tuple[int, int]]
    bodies: list[bytes]


def split(req: GradientRequest, prep: Prepared, count: int) -> Split:
    """The row shards, then options.curvature's Lanczos jobs over the whole batch (gradsvc/engine/diagnostics/
    sharded.py: the row shards compute the trace's part, if any)."""
    validate_shardable(prep, count)
    bounds = split_rows(prep.inputs.rows, count)
    plan = plan_for(prep, [b - a for a, b in bounds])
    # Mixed mean/sum losses: a shard's combined gradient cannot be rescaled as a whole, so each shard
    # returns its per-loss gradients and the reduction weighs them term by term.
    per_loss = req.options.per_loss if plan.uniform else True
    rows_req = msgspec.structs.replace(req, options=msgspec.structs.replace(
        req.options, curvature=sharded_curvature.row_curvature(req.options.curvature)))
    bodies = [_encoder.encode(r) for r in shard_requests(rows_req, prep, bounds, per_loss=per_loss)]
    for options in sharded_curvature.lanczos_options(req.options, plan.lanczos):
        bodies.append(_encoder.encode(msgspec.structs.replace(req, options=options)))
        bounds.append((0, prep.inputs.rows))
    return Split(plan, bounds, bodies)


@dataclasses.dataclass
class Fan:
    """A sharded job on its way to the queue: its id (the reduce job's), its owner, its cut, and each shard's
    job id and argument (its body, or its body's handoff ref)."""

    job_id: str
    owner: str
    cut: Split
    shard_ids: list[str]
    args: list[bytes | str]


def enqueue(queue: Queue, handoff: Handoff | None, cut: Split, record: JobRecord, owner: str, job_id: str) -> None:
    """Queues the shard jobs and their reduce job (id `job_id`) in one Redis transaction. `handoff`: the
    job goes through the domain's queue (the shards' results and references come back as files, which the
    reduce job reads), each large shard body as a file; None when it goes through Redis."""
    shard_ids = [shard_job_id(job_id, k) for k in range(len(cut.bounds))]
    args: list[bytes | str] = list(cut.bodies)
    if handoff is not None:
        try:
            args = [handoff.put(sid, handoff_files.INPUT, b) if handoff.wanted(len(b)) else b
                    for sid, b in zip(shard_ids, cut.bodies)]
        except OSError:  # the tmpfs is full: Redis still takes the bodies
            for sid in shard_ids:
                handoff.discard(sid)
    try:
        _enqueue(queue, Fan(job_id, owner, cut, shard_ids, args), record)
    except BaseException:
        if handoff is not None:
            for sid in shard_ids:
                handoff.discard(sid)
        raise


def _shard_jobs(fan: Fan, record: JobRecord) -> list:
    """Each shard's job, as RQ's Group enqueues them: its rows' request, its place in the fan-in."""
    count = len(fan.shard_ids)
    return [
        Queue.prepare_data(SHARD_JOB, (arg,), job_id=sid, on_failure=Callback(shard_failed),
                           description=f"gradients shard {k} of {count} (rows {a}:{b})",
                           meta=JobMeta(shard=ShardPlace(parent=fan.job_id, index=k, count=count, rows=[a, b],
                                                         prefix=record.prefix, owner=fan.owner)).as_meta(),
                           **_ttls(record))
        for k, (sid, arg, (a, b)) in enumerate(zip(fan.shard_ids, fan.args, fan.cut.bounds))]


def _ttls(record: JobRecord) -> dict[str, int]:
    return {"timeout": record.timeout_s, "result_ttl": record.result_ttl_s, "failure_ttl": record.failure_ttl_s}


def _enqueue(queue: Queue, fan: Fan, record: JobRecord) -> None:
    shard_jobs = _shard_jobs(fan, record)
    job_id, owner, shard_ids = fan.job_id, fan.owner, fan.shard_ids
    reduce = queue.create_job(REDUCE_JOB, args=(dataclasses.asdict(fan.cut.plan), shard_ids), job_id=job_id,
                              depends_on=Dependency(jobs=shard_ids), status=JobStatus.DEFERRED,
                              description=f"gradients, {len(shard_ids)} shards",
                              meta=JobMeta(owner=owner, shards=shard_ids).as_meta(), **_ttls(record))
    reduce.origin = queue.name
    reduce.enqueued_at = now()
    # One MULTI/EXEC: no worker can take a shard before its reduce job is registered as its dependent (a
    # shard that failed first would have no job to fail). Group.enqueue_many executes the pipeline.
    with queue.connection.pipeline() as pipe:
        reduce.save(pipeline=pipe)
        reduce.register_dependency(pipeline=pipe)
        recent.record(pipe, record.prefix, owner, job_id, record.index_ttl_s)
        Group(queue.connection, name=job_id).enqueue_many(queue, shard_jobs, pipeline=pipe)
