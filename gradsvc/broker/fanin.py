"""The fan-in of sharded jobs: a failed shard fails its job (RQ's on_failure callback), DELETE cancels the
shards, and the handoff files of the shards that no reduce will read are deleted."""

from __future__ import annotations

from redis import Redis
from redis.exceptions import WatchError
from rq.exceptions import AbandonedJobError
from rq.job import Job, JobStatus
from rq.job_lifecycle import record_job_failure
from rq.registry import DeferredJobRegistry
from rq.results import Result
from rq.utils import now, utcformat

from gradsvc.broker import handoff as handoff_files
from gradsvc.broker import keys
from gradsvc.broker.job import MsgpackSerializer
from gradsvc.broker.record import JobMeta, error_meta, set_error
from gradsvc.wire import ErrorInfo


def shard_job_id(job_id: str, index: int) -> str:
    """The RQ job id of shard `index` of the sharded job `job_id` (the reduce job's id)."""
    return f"{job_id}-shard-{index}"


_LOST = ("worker_lost", "the worker running it was lost (killed, crashed, or cut off from Redis) before it finished; "
         "submit the job again")


def shard_failed(job: Job, connection: Redis, exc_type, exc_value, tb) -> None:
    """RQ's on_failure callback of a shard job: the first shard to fail fails the job with its code and
    index; every other shard is canceled (queued ones at once, running ones at their next step)."""
    meta = JobMeta.of(job.meta)
    info, error = meta.shard, meta.error
    if info is None:
        return
    parent, index, count, prefix = info.parent, info.index, info.count, info.prefix
    if error is None:
        code, why = _LOST if exc_type is AbandonedJobError or exc_type is None else (
            "internal_error", f"it failed unexpectedly ({getattr(exc_type, '__name__', exc_type)})")
        error = ErrorInfo(code=code, message=why)
    # The flag stops the running siblings (they poll it) and any that starts later.
    connection.set(keys.cancel_key(prefix, parent), b"1", ex=max(int(job.timeout or 600), 60) + 60)
    siblings = [shard_job_id(parent, k) for k in range(count or 0) if k != index]
    cancel_queued(connection, siblings)
    if siblings:  # results of siblings that finished first: no reduce job will read them
        connection.delete(*[key(prefix, sid) for sid in siblings for key in (keys.result_key, keys.reference_key)])
    discard_files(connection, [job.id, *siblings])  # and their handoff files (this shard's own reference too)
    if error.code == "canceled":
        return  # the job was canceled (DELETE), or a sibling failed first and already failed it
    rows = info.rows
    message = f"shard {index} of {count} (rows {rows[0]}:{rows[1]}) failed: {error.message}" if rows else \
        f"shard {index} of {count} failed: {error.message}"
    detail = {**error.detail, "shard": index, "shards": count, "shard_job_id": job.id}
    fail_parent(connection, parent, error_meta(error.code, message, detail))


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
                set_error(parent, error)
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
    cancel_queued(connection, JobMeta.of(job.meta).shards or [])
    if job.get_status(refresh=True) == JobStatus.CANCELED:
        Result.create_failure(job, job.failure_ttl, "canceled by POST /jobs/{id}/cancel")


def cancel_queued(connection: Redis, shard_ids: list[str]) -> None:
    """Cancels the shards still queued (deleting their handed-off bodies); running ones stop at their next
    step on the job's cancel flag."""
    canceled = []
    for shard in Job.fetch_many(shard_ids, connection=connection, serializer=MsgpackSerializer):
        if shard is not None and shard.get_status(refresh=False) == JobStatus.QUEUED:
            shard.cancel()
            canceled.append(shard.id)
    discard_files(connection, canceled)


def discard_files(connection: Redis, job_ids: list[str]) -> None:
    """Deletes the handoff files (body, result, reference) of these jobs or shards, where this process has
    the handoff dir they were written to (the one bound to its Redis client: handoff.bind); elsewhere the
    domain's sweep deletes them after their TTL."""
    handoff = handoff_files.bound(connection)
    if handoff is None:
        return
    for job_id in job_ids:
        try:
            handoff.discard(job_id)
        except (OSError, handoff_files.HandoffError):
            pass
