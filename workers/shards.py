"""The queue side of a sharded request (service/shards.py fans it out): the shard job (its rows,
computed as any job), the reduce job (the shards' results -> the job's result) and the fan-in of a
failure (a failed or lost shard fails the job, naming itself, and cancels its siblings).

A failure reaches `shard_failed` through RQ's on_failure callback, from the worker that ran the shard
or, for a shard whose worker died, from whichever process reaps its lapsed lease (a worker's
heartbeat thread, or the API reading the job): both reap through `LeaseRegistry`.
"""

from __future__ import annotations

import logging
import time

import msgspec
from redis import Redis
from redis.exceptions import WatchError
from rq.exceptions import AbandonedJobError
from rq.job import Job, JobStatus
from rq.job_lifecycle import record_job_failure
from rq.registry import DeferredJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.timeouts import TimerDeathPenalty
from rq.utils import now, utcformat

from gradsvc import keys
from gradsvc.wire import GradientResult

from .engine import ComputeError
from .engine.reduce import ShardPlan, add_reduce_time, reduce_results
from .jobs import JobCanceledError, WorkerContext, compute_request, run_job
from .serializer import MsgpackSerializer

log = logging.getLogger("gradsvc.worker")
_result_decoder = msgspec.msgpack.Decoder(GradientResult)


def shard_job_id(job_id: str, index: int) -> str:
    """The RQ job id of shard `index` of the sharded job `job_id` (the reduce job's id)."""
    return f"{job_id}-shard-{index}"


class LeaseRegistry(StartedJobRegistry):
    """RQ's StartedJobRegistry, whose cleanup (failing abandoned jobs) may run outside the main thread: RQ
    runs failure callbacks under a SIGALRM timeout, which only the main thread may set, so a shard reaped
    from a heartbeat thread would never fail its job. A timer thread enforces the timeout instead."""

    death_penalty_class = TimerDeathPenalty


def shard_job(body: bytes) -> dict:
    """One shard: a normal request over its rows; its result goes to its own result key for the reduce job."""

    def work(job: Job, ctx: WorkerContext, queue_s: float) -> GradientResult:
        parent = job.meta["shard"]["parent"]
        result = compute_request(job, ctx, body, "msgpack", queue_s, cancel_id=parent)
        if job.connection.exists(keys.cancel_key(ctx.settings.queue_prefix, parent)):
            raise JobCanceledError()  # the job was canceled or a sibling failed while this one ran
        return result

    return run_job(work, kind="shard")


def reduce_job(plan: dict, shard_ids: list[str]) -> dict:
    """Runs once every shard has finished (an RQ Dependency on all of them): combines their results into
    the job's result and deletes theirs."""

    def work(job: Job, ctx: WorkerContext, queue_s: float) -> GradientResult:
        started = time.perf_counter()
        prefix = ctx.settings.queue_prefix
        shard_keys = [keys.result_key(prefix, sid) for sid in shard_ids]
        raws = job.connection.mget(shard_keys)
        missing = [k for k, raw in enumerate(raws) if raw is None]
        if missing:
            raise ComputeError("internal_error", f"the results of shards {missing} expired before they could be "
                               "combined (GRADSVC_RESULT_TTL_S); submit the job again", shards=missing)
        results = [_result_decoder.decode(raw) for raw in raws]
        del raws
        result = reduce_results(results, ShardPlan(**plan))
        # The returned-gradient check of the combined gradient belongs here, once the engine can check a
        # given gradient against the float64 reference of the whole batch; until then `numcheck` is the
        # worst shard's (result.shards.numcheck_shard names it).
        add_reduce_time(result, 1e3 * (time.perf_counter() - started))
        job.connection.delete(*shard_keys)
        return result

    return run_job(work, kind="reduce")


# --- a shard failed: fail its job -----------------------------------------------------------------------
_LOST = ("worker_lost", "the worker running it was lost (killed, crashed, or cut off from Redis) before it finished; "
         "submit the job again")


def shard_failed(job: Job, connection: Redis, exc_type, exc_value, tb) -> None:
    """RQ's on_failure callback of a shard job: the first shard to fail fails the job with its code and
    index; every other shard is canceled (queued ones at once, running ones at their next step)."""
    info = job.meta.get("shard") or {}
    parent, index, count = info.get("parent"), info.get("index"), info.get("count")
    if parent is None:
        return
    prefix = info.get("prefix", "gradsvc")
    error = job.meta.get("error")
    if error is None:
        code, why = _LOST if exc_type is AbandonedJobError or exc_type is None else (
            "internal_error", f"it failed unexpectedly ({getattr(exc_type, '__name__', exc_type)})")
        error = {"code": code, "message": why, "detail": {}}
    # The flag stops the running siblings (they poll it) and any that starts later.
    connection.set(keys.cancel_key(prefix, parent), b"1", ex=max(int(job.timeout or 600), 60) + 60)
    siblings = [shard_job_id(parent, k) for k in range(count or 0) if k != index]
    cancel_queued(connection, siblings)
    if siblings:  # results of siblings that finished first: no reduce job will read them
        connection.delete(*[keys.result_key(prefix, sid) for sid in siblings])
    if error["code"] == "canceled":
        return  # the job was canceled (DELETE), or a sibling failed first and already failed it
    rows = info.get("rows")
    message = f"shard {index} of {count} (rows {rows[0]}:{rows[1]}) failed: {error['message']}" if rows else \
        f"shard {index} of {count} failed: {error['message']}"
    detail = {**error.get("detail", {}), "shard": index, "shards": count, "shard_job_id": job.id}
    fail_parent(connection, parent, {"code": error["code"], "message": message, "detail": detail})


def settle(connection: Redis, shard_id: str) -> None:
    """Runs the fan-in again for a shard found failed while its job still waits (its failure callback
    could not run to the end, e.g. Redis went away meanwhile); a no-op once the job has ended."""
    try:
        shard = Job.fetch(shard_id, connection=connection, serializer=MsgpackSerializer)
    except Exception:
        return
    shard_failed(shard, connection, None, None, None)


def fail_parent(connection: Redis, parent_id: str, error: dict) -> bool:
    """Fails a sharded job still waiting on its shards (RQ status deferred): its error in meta, RQ's failure
    records (FailedJobRegistry, a failure entry on its results stream, which wakes a waiting POST)."""
    key = Job.key_for(parent_id)
    with connection.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                try:
                    parent = Job.fetch(parent_id, connection=connection, serializer=MsgpackSerializer)
                except Exception:  # expired or never saved
                    pipe.reset()
                    return False
                if parent.get_status(refresh=False) != JobStatus.DEFERRED:
                    pipe.reset()
                    return False  # already failed by a sibling, canceled, or (impossible) running
                pipe.multi()
                parent.meta["error"] = error
                # Meta and end time in the same transaction as the status (Job.save_meta takes no pipeline).
                pipe.hset(key, mapping={"meta": MsgpackSerializer.dumps(parent.meta), "ended_at": utcformat(now())})
                record_job_failure(parent, f"{error['code']}: {error['message']}", pipe)
                DeferredJobRegistry(parent.origin, connection=connection, serializer=MsgpackSerializer).remove(
                    parent, pipeline=pipe)
                pipe.execute()
                return True
            except WatchError:
                continue


def cancel_shards(connection: Redis, job: Job) -> None:
    """DELETE of a sharded job, after the job's own cancel: its queued shards are canceled at once (running
    ones stop on the job's cancel flag), and a POST waiting on it wakes (RQ's cancel writes no result)."""
    cancel_queued(connection, job.meta["shards"])
    if job.get_status(refresh=True) == JobStatus.CANCELED:
        Result.create_failure(job, job.failure_ttl, "canceled by DELETE /jobs/{id}")


def cancel_queued(connection: Redis, shard_ids: list[str]) -> None:
    """Cancels the shards still queued; running ones stop at their next step on the job's cancel flag."""
    for shard in Job.fetch_many(shard_ids, connection=connection, serializer=MsgpackSerializer):
        if shard is not None and shard.get_status(refresh=False) == JobStatus.QUEUED:
            shard.cancel()
