"""The queue's format, shared by the API and the workers: RQ's job class and serializer, the lease, the
job functions' names, and the fan-in of sharded jobs (a failed shard fails its job; DELETE cancels the
shards). Redis and RQ only: no torch, no HTTP.
"""

from __future__ import annotations

from typing import Any

import msgspec
from redis import Redis
from redis.connection import Encoder, HiredisRespSerializer, PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE
from redis.exceptions import WatchError
from rq.exceptions import AbandonedJobError
from rq.job import Job, JobStatus
from rq.job_lifecycle import record_job_failure
from rq.registry import DeferredJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.timeouts import TimerDeathPenalty
from rq.utils import now, utcformat

from gradsvc import handoff as handoff_files
from gradsvc import keys

# The functions RQ calls, by dotted path (the API enqueues them; the workers import them).
JOB_FUNCTION = "gradsvc.workers.jobs.gradient_job"
SHARD_FUNCTION = "gradsvc.workers.shards.shard_job"
REDUCE_FUNCTION = "gradsvc.workers.shards.reduce_job"
SHARD_FAILED = "gradsvc.queue.shard_failed"

# A worker renews its jobs' leases every heartbeat; a job (or worker) silent for this many heartbeats is lost.
LEASE_HEARTBEATS = 3


def lease_s(heartbeat_s: float) -> int:
    return int(LEASE_HEARTBEATS * heartbeat_s)


def sync_redis(url: str, **kwargs: Any) -> Redis:
    """A redis-py client for `url` that sends large values without copying them. With hiredis installed
    (the server extra installs it, for its reply parser) redis-py packs every command through
    hiredis.pack_command, which copies each argument twice: 36-56 ms per 33 MB SET here, on the path of
    every large request and result. redis-py's own packer sends a large value as it is (_Packer)."""
    return Redis.from_url(url, command_packer=_Packer(), **kwargs)


_BUFFER_CUTOFF = 6000  # redis-py's: values longer than this are sent as their own buffer
_LARGE = 1 << 16


class _Packer:
    """hiredis's packer (C) for commands of small values, most of a job's ~40; redis-py's (no copy of a
    large value, but Python per argument: 9% of a worker's time on small jobs here) for any larger one."""

    def __init__(self) -> None:
        self.python = PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)
        self.hiredis = HiredisRespSerializer() if HIREDIS_AVAILABLE else None

    def pack(self, *args: Any) -> list:
        if self.hiredis is None or any(isinstance(a, (bytes, bytearray, memoryview)) and len(a) > _LARGE
                                       for a in args):
            return self.python.pack(*args)
        return self.hiredis.pack(*args)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class MsgpackSerializer:
    """RQ's serializer for gradsvc queues: MessagePack via msgspec, so no pickle crosses Redis. Passed to
    RQ as a class: RQ's worker resolves serializers by class, not instance."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return _encoder.encode(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        return _decoder.decode(data)


class GradientJob(Job):
    """RQ's Job, storing its data (the request body) uncompressed. RQ zlib-compresses it on every save, at
    enqueue and again when the job ends: ~40 MB/s on tensor bytes that do not compress, 55 ms per 2 MB on
    the path of every request (bench/medium_job.py). RQ's loader reads uncompressed data as it is."""

    # Set on a job read from Redis: its data is there already, and RQ's later saves of it (started,
    # finished, failed) rewrite every field: for a 33 MB request, one more 33 MB write at the end of the job.
    _data_stored = False
    # A result run_job hands over for the success transaction: (key, bytes, ttl) (see _handle_success).
    pending_result: tuple[str, bytes, int] | None = None
    result_flushed = False  # the pending result went into a transaction (flush_result)

    def restore(self, raw_data) -> None:
        super().restore(raw_data)
        self._data_stored = True

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict:
        data = self.data
        self._data = b""  # what RQ compresses: nothing
        try:
            obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        finally:
            self._data = data
        if self._data_stored:
            del obj["data"]  # HSET keeps the stored field as it is
        else:
            obj["data"] = data
        return obj

    def _handle_success(self, result_ttl, pipeline, **kwargs) -> None:
        """RQ's success bookkeeping (status, results stream, FinishedJobRegistry), with the job's result
        written in the same transaction: one round trip less per job, and the result is in Redis the
        moment the results stream wakes the waiting API."""
        self.flush_result(pipeline)
        super()._handle_success(result_ttl, pipeline, **kwargs)

    def flush_result(self, connection) -> None:
        """Writes the pending result through `connection` (a pipeline: again on each retry of a transaction
        that a WatchError aborted; the worker drops it once the transaction went through)."""
        if self.pending_result is not None:
            key, data, ttl = self.pending_result
            connection.set(key, data, ex=ttl)
            self.result_flushed = True


def shard_job_id(job_id: str, index: int) -> str:
    """The RQ job id of shard `index` of the sharded job `job_id` (the reduce job's id)."""
    return f"{job_id}-shard-{index}"


class LeaseRegistry(StartedJobRegistry):
    """RQ's StartedJobRegistry, whose cleanup (failing abandoned jobs) may run outside the main thread: RQ
    runs failure callbacks under a SIGALRM timeout, which only the main thread may set, so a shard reaped
    from a heartbeat thread would never fail its job. A timer thread enforces the timeout instead."""

    death_penalty_class = TimerDeathPenalty


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
        connection.delete(*[key(prefix, sid) for sid in siblings for key in (keys.result_key, keys.reference_key)])
    discard_files([job.id, *siblings])  # and their handoff files (this shard's own reference too)
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
    """Cancels the shards still queued (deleting their handed-off bodies); running ones stop at their next
    step on the job's cancel flag."""
    canceled = []
    for shard in Job.fetch_many(shard_ids, connection=connection, serializer=MsgpackSerializer):
        if shard is not None and shard.get_status(refresh=False) == JobStatus.QUEUED:
            shard.cancel()
            canceled.append(shard.id)
    discard_files(canceled)


def discard_files(job_ids: list[str]) -> None:
    """Deletes the handoff files (body, result, reference) of these jobs or shards, where this process has
    the handoff dir they were written to; elsewhere the domain's sweep deletes them after their TTL."""
    handoff = handoff_files.installed()
    if handoff is None:
        return
    for job_id in job_ids:
        try:
            handoff.discard(job_id)
        except (OSError, handoff_files.HandoffError):
            pass
