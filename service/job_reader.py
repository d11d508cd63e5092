"""What the API reads of a job, and the one thing it does to one: waiting for its end on RQ's results stream,
its view (GET /jobs/{id}: status, progress, error, result), cancel, and what /readyz and /metrics read."""

from __future__ import annotations

import base64
import logging
import zlib
from datetime import datetime, timezone
from typing import NamedTuple

import anyio
import anyio.to_thread
import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.utils import utcparse

from gradsvc.broker import handoff as handoff_files
from gradsvc.broker import keys
from gradsvc.broker.connection import send_async
from gradsvc.broker.fanin import cancel_shards, settle
from gradsvc.broker.handoff import HandoffError
from gradsvc.broker.job import MsgpackSerializer
from gradsvc.broker.leases import LeaseRegistry, lease_s
from gradsvc.broker.record import JobMeta, write_error
from gradsvc.wire import ErrorInfo, GradientResult, JobInfo, Progress

from .exceptions import ServiceError
from .queues import Queues

log = logging.getLogger("gradsvc")
_STATUS = {"created": "queued", "deferred": "queued", "scheduled": "queued", "queued": "queued",
           "started": "started", "finished": "finished", "failed": "failed", "stopped": "canceled",
           "canceled": "canceled"}
_result_decoder = msgspec.msgpack.Decoder(GradientResult)
_FIELDS = ("status", "meta", "enqueued_at", "started_at", "ended_at", "origin", "last_heartbeat")
_JOB_LOST = {"code": "job_lost", "message": "Redis lost this job's record (it was restarted without its data); whether "
             "the job ran is unknown and its result, if any, is gone; submit it again", "detail": {}}
_WORKER_LOST = {"code": "worker_lost", "message": "the worker running this job was lost (killed, crashed, or cut off "
                "from Redis) before it finished; submit it again", "detail": {}}
# A result key's first bytes: a handoff marker (MARKER and its ref) is shorter.
_MARKER_PEEK = 512
# An open wait looks for a lapsed lease this often (one HMGET), between blocking reads.
LEASE_CHECK_S = 1.0


class _Record(NamedTuple):
    """What JobReader.info reads of a job in one round trip: its hash's _FIELDS, then its result's length and head."""

    status: bytes | None
    meta: bytes | None
    enqueued: bytes | None
    started: bytes | None
    ended: bytes | None
    origin: bytes | None
    beat: bytes | None
    result_len: int
    result_head: bytes


def slice_commands(prefix: str, job_id: str, block_s: float) -> list[tuple]:
    """A slice of JobReader.wait: one XREAD of the job's results stream, blocking up to block_s, and its result's
    GET, which Redis runs as soon as the XREAD returns (a finished job costs one round trip, not two)."""
    return [("XREAD", "COUNT", 1, "BLOCK", max(1, int(block_s * 1000)), "STREAMS", keys.rq_results_stream(job_id),
             "0-0"), ("GET", keys.result_key(prefix, job_id))]


def unavailable(job_id: str, exc: BaseException) -> ServiceError:
    return ServiceError("queue_unavailable", f"the job queue (Redis) stopped answering while waiting for job {job_id} "
                        f"({type(exc).__name__}); poll GET /jobs/{job_id} once it is back",
                        headers={"Retry-After": "2"}, job_id=job_id)


def _iso(raw: bytes | None) -> str | None:
    return raw.decode() if raw else None


# GET /jobs/{id} reads a result up to this size in its first round trip; a larger one (up to
# GRADSVC_MAX_RESULT_BYTES) in a second, bounded by its size at RESULT_READ_BYTES_S.
RESULT_IN_ONE = 1 << 20
RESULT_READ_BYTES_S = 10e6


class JobReader:
    def __init__(self, queues: Queues, *, heartbeat_s: int, redis_timeout_s: float, job_timeout_s: int) -> None:
        self.queues = queues
        self.redis, self.aredis, self.ablocking = queues.redis, queues.aredis, queues.ablocking
        self.prefix = queues.prefix
        self.epochs = queues.epochs
        self.lease_s = lease_s(heartbeat_s)
        self.redis_timeout_s = redis_timeout_s
        self.job_timeout_s = job_timeout_s

    async def wait(self, job_id: str, timeout_s: float) -> tuple[bool, bytes | None]:
        """(ended, stored result) once the job has ended within timeout_s. Waits in slices of a second: a
        job whose worker died ends only when someone notices its lapsed lease, and between slices this
        wait does (so an open wait answers worker_lost within the lease, not only when it runs out)."""
        if timeout_s <= 0:
            return False, None
        return await self.wait_until(job_id, anyio.current_time() + timeout_s)

    async def wait_until(self, job_id: str, deadline: float, reap_first: bool = False) -> tuple[bool, bytes | None]:
        """wait()'s slices up to `deadline` (anyio.current_time()'s); `reap_first`: a slice came before."""
        if reap_first:
            await self._reap_if_lapsed(job_id)
        while True:
            left = max(deadline - anyio.current_time(), 0.001)
            ended, raw = await self._wait_slice(job_id, min(left, LEASE_CHECK_S), left)
            if ended or left <= LEASE_CHECK_S:
                return ended, raw
            await self._reap_if_lapsed(job_id)

    async def _reap_if_lapsed(self, job_id: str) -> None:
        try:
            status, origin, beat = await self.aredis.hmget(Job.key_for(job_id), ("status", "origin", "last_heartbeat"))
        except (RedisConnectionError, RedisTimeoutError):
            return  # the next slice's XREAD reports the outage
        if status == b"started" and origin and self._lease_lapsed(beat):
            await anyio.to_thread.run_sync(self.reap_abandoned, origin.decode())

    async def _wait_slice(self, job_id: str, block_s: float, left_s: float) -> tuple[bool, bytes | None]:
        """One XREAD on RQ's results stream, blocking up to block_s. The result GET rides in the same
        pipeline: Redis runs it as soon as the XREAD returns, so a finished job costs one round trip, not
        two. The pair may take the whole wait that is left (a large result takes seconds to read), plus
        one Redis timeout: past that Redis is taken for hung."""
        try:
            with anyio.fail_after(left_s + self.redis_timeout_s):
                got, raw = await send_async(self.ablocking, slice_commands(self.prefix, job_id, block_s))
        except (RedisConnectionError, RedisTimeoutError, TimeoutError) as exc:
            raise unavailable(job_id, exc) from None
        return bool(got), await self.load_result(raw, job_id) if got else None

    async def load_result(self, raw: bytes | None, job_id: str) -> bytes | None:
        """A result key's value as the result's bytes: as stored, or the handoff file its marker names, mapped
        (in a thread: Handoff.map); None once either has expired."""
        if not handoff_files.is_marker(raw):
            return raw
        try:
            return await anyio.to_thread.run_sync(handoff_files.load, raw, self.queues.handoff, True)
        except HandoffError as exc:
            # Handoff on behind a balancer over several hosts: each API reads only its own host's files.
            raise ServiceError("result_elsewhere", f"the result of job {job_id} is a file on another host's "
                               f"GRADSVC_HANDOFF_DIR ({exc}); ask the API on the host that took the job, or turn "
                               "GRADSVC_HANDOFF_DIR off where several API hosts share one Redis", job_id=job_id,
                               ref=handoff_files.marker_ref(raw)[:100]) from None

    async def _large_result(self, job_id: str, size: int) -> bytes | None:
        """A result stored in Redis larger than RESULT_IN_ONE: read on the long-timeout pool, within the Redis
        timeout plus its size at RESULT_READ_BYTES_S (GPT-2 small's 0.5 GB took longer than the short
        timeout on this loaded 2-core host, so GET /jobs answered 503 for a finished job)."""
        try:
            with anyio.fail_after(self.redis_timeout_s + size / RESULT_READ_BYTES_S):
                return await self.ablocking.get(keys.result_key(self.prefix, job_id))
        except (RedisConnectionError, RedisTimeoutError, TimeoutError) as exc:
            raise ServiceError("queue_unavailable", f"the job queue (Redis) stopped answering while the result of "
                               f"job {job_id} was read ({type(exc).__name__}); poll GET /jobs/{job_id} again",
                               headers={"Retry-After": "2"}, job_id=job_id) from None

    async def info(self, job_id: str, owner: str, *, with_result: bool = True, _reaped: bool = False) -> JobInfo:
        rec = await self._read(job_id)
        if rec.status == b"started" and rec.origin and not _reaped and self._lease_lapsed(rec.beat):
            # No worker renewed this job's lease: fail it now (AbandonedJobError -> worker_lost) rather than
            # wait for a worker's reaper, so a job outlives no worker at all as "started".
            await anyio.to_thread.run_sync(self.reap_abandoned, rec.origin.decode())
            return await self.info(job_id, owner, with_result=with_result, _reaped=True)
        meta = JobMeta.of(MsgpackSerializer.loads(rec.meta) if rec.meta else None)
        status, shard_progress = rec.status, None
        if meta.shards and status in (b"deferred", b"queued", b"started"):
            shards = await self._shards(meta.shards, status, _reaped)
            if shards is None:
                return await self.info(job_id, owner, with_result=with_result, _reaped=True)
            status, shard_progress = shards
        if (rec.meta is None or status is None) and await anyio.to_thread.run_sync(self.epochs.is_lost, job_id):
            # No record, or only what a worker wrote after Redis lost it (a heartbeat, its progress, an end),
            # for an id an API issued before Redis restarted empty: lost. Its owner went with the record, or
            # came back only in the meta of a job whose worker then dropped its outcome (workers/worker.py
            # _reaped): without a status, that job never ends.
            return JobInfo(job_id=job_id, status="failed", error=ErrorInfo(**_JOB_LOST), progress=None, result=None,
                           enqueued_at=None, started_at=None, ended_at=_iso(rec.ended))
        if status is None or meta.owner != owner:
            # Another key's job reads as unknown: its existence is not disclosed.
            raise ServiceError("not_found", f"no job {job_id!r}; it never existed, belongs to another API key, or "
                               "expired (results are kept GRADSVC_RESULT_TTL_S seconds)", job_id=job_id)
        state = "canceled" if meta.is_canceled else _STATUS.get(status.decode(), "queued")
        error = meta.error
        if state == "failed" and not error:
            error = ErrorInfo(**await self._failure_from_rq(job_id))
        result = await self._result(job_id, rec) if state == "finished" and with_result else None
        return JobInfo(job_id=job_id, status=state, progress=shard_progress or meta.progress, error=error,
                       result=result, enqueued_at=_iso(rec.enqueued), started_at=_iso(rec.started),
                       ended_at=_iso(rec.ended))

    async def _read(self, job_id: str) -> _Record:
        """The job's hash fields and its result's first RESULT_IN_ONE bytes, in one round trip."""
        pipe = self.aredis.pipeline(transaction=False)
        pipe.hmget(Job.key_for(job_id), _FIELDS)
        pipe.strlen(keys.result_key(self.prefix, job_id))
        pipe.getrange(keys.result_key(self.prefix, job_id), 0, RESULT_IN_ONE - 1)
        fields, result_len, result_head = await pipe.execute()
        return _Record(*fields, result_len, result_head)

    async def _shards(self, shard_ids: list[str], status: bytes,
                      reaped: bool) -> tuple[bytes, Progress] | None:
        """A sharded job still waiting or running: (its status, read from its shards as well, its progress);
        None when a shard was reaped or settled here, so the job is to be read again."""
        done, running, leases, failed = await _shard_progress(self.aredis, shard_ids)
        lapsed = {origin for origin, shard_beat in leases if self._lease_lapsed(shard_beat)}
        if (lapsed or (failed and status == b"deferred")) and not reaped:
            # As for a job, for a shard: reaped, it fails the job (workers/shards.py); a failed shard whose
            # job still waits had its fan-in cut short: run it again.
            for queue_name in lapsed:
                await anyio.to_thread.run_sync(self.reap_abandoned, queue_name)
            for shard_id in failed:
                await anyio.to_thread.run_sync(settle, self.redis, shard_id)
            return None
        total = len(shard_ids)
        progress = (Progress(phase="shards", done=done, total=total) if done < total else
                    Progress(phase="reduce", done=total, total=total))
        if running and status in (b"deferred", b"queued"):  # shards running, or all done and reducing next
            status = b"started"
        return status, progress

    async def _result(self, job_id: str, rec: _Record) -> GradientResult:
        """A finished job's result: read whole by _read, or in a second read when larger, or from its file."""
        raw = rec.result_head
        if rec.result_len > RESULT_IN_ONE:
            raw = await self._large_result(job_id, rec.result_len)
        raw = await self.load_result(raw or None, job_id)
        if raw is None:
            raise ServiceError("not_found", f"the result of job {job_id!r} has expired, or its owner released it "
                               "(Gradsvc-Release-Results)", job_id=job_id)
        return _result_decoder.decode(raw)

    def _lease_lapsed(self, beat: bytes | None) -> bool:
        if not beat:
            return False
        try:
            age_s = (datetime.now(timezone.utc) - utcparse(beat.decode())).total_seconds()
        except ValueError:
            return False
        return age_s > self.lease_s + 1

    def reap_abandoned(self, queue_name: str) -> None:
        """RQ fails every started job in the queue whose lease lapsed (its worker died or lost Redis)."""
        LeaseRegistry(queue_name, connection=self.redis, serializer=MsgpackSerializer).cleanup()

    @staticmethod
    def decode_result(raw: bytes) -> GradientResult:
        return _result_decoder.decode(raw)

    async def _failure_from_rq(self, job_id: str) -> dict:
        """A job that failed without writing its error (killed worker, abandoned, timed out outside the job)."""
        entries = await self.aredis.xrevrange(keys.rq_results_stream(job_id), "+", "-", count=1)
        exc = ""
        if entries:
            raw = entries[0][1].get(b"exc_string")
            if raw:
                exc = zlib.decompress(base64.b64decode(raw)).decode(errors="replace")
        if "AbandonedJobError" in exc or "moved to FailedJobRegistry" in exc.lower() or not exc:
            return dict(_WORKER_LOST)
        if "JobTimeoutException" in exc:
            return {"code": "timeout", "message": "the job ran past GRADSVC_JOB_TIMEOUT_S", "detail": {}}
        return {"code": "internal_error", "message": exc.strip().splitlines()[-1][:500], "detail": {}}

    def cancel(self, job_id: str) -> None:
        try:
            job = Job.fetch(job_id, connection=self.redis, serializer=MsgpackSerializer)
        except NoSuchJobError:
            raise ServiceError("not_found", f"no job {job_id!r}; it expired", job_id=job_id) from None
        status = job.get_status(refresh=False)
        status = status.value if status is not None else "queued"
        if status not in ("queued", "deferred", "scheduled", "created", "started"):
            return  # already ended: nothing to cancel
        # The flag also stops a job a worker took between the status read above and job.cancel() below.
        self.redis.set(keys.cancel_key(self.prefix, job_id), b"1", ex=self.job_timeout_s + 60)
        if status != "started":
            job.cancel()
            if self.queues.handoff is not None:  # its handed-off body: no worker will read it now
                self.queues.handoff.discard(job_id)
            write_error(job, "canceled", "canceled by POST /jobs/{id}/cancel before it started")
        if JobMeta.of(job.meta).shards:
            cancel_shards(self.redis, job)  # its shards, queued or running (they poll the flag set above)

    def release(self, job_ids: list[str], owner: str) -> tuple[int, bool]:
        """Drops the results of those of `job_ids` that are this owner's finished jobs (Gradsvc-Release-Results):
        their result keys, and their handoff files on this host. Returns (results dropped, whether the API's
        spare took a file's pages). A job of another key, one not finished, or one Redis no longer has is left
        as it is. On a VM pages already written are the quick ones to write again (Spare's docstring), so the
        first file no one reads is kept as the spare, for the request's own body. Best effort: Redis
        unreachable drops nothing (the TTL still does)."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.hmget(Job.key_for(job_id), ("status", "meta"))
                pipe.getrange(keys.result_key(self.prefix, job_id), 0, _MARKER_PEEK - 1)
            replies = pipe.execute()
            dropped = []
            for job_id, (status, meta_raw), head in zip(job_ids, replies[::2], replies[1::2]):
                if status == b"finished" and meta_raw and JobMeta.of(MsgpackSerializer.loads(meta_raw)).owner == owner:
                    dropped.append((job_id, head))
            if dropped:
                self.redis.delete(*(keys.result_key(self.prefix, job_id) for job_id, _ in dropped))
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("results not released, Redis unreachable (%s); they expire with their TTL", exc)
            return 0, False
        spare, recycled = self.queues.spare, False
        for _, head in dropped:
            if handoff_files.drop(head, self.queues.handoff, None if recycled else spare):
                recycled = spare is not None
        return len(dropped), recycled

    # --- what /readyz and /metrics read from Redis -------------------------------------------------
    def ping(self) -> bool:
        return bool(self.redis.ping())

    def probe_write(self) -> None:
        """One short-lived write: Redis at maxmemory, read-only or failing its snapshots raises here."""
        self.redis.set(keys.write_probe_key(self.prefix), b"1", px=10_000)

    def workers(self) -> list[Worker]:
        return Worker.all(connection=self.redis)

    def queue_depths(self) -> dict[str, int]:
        return queue_depths(self.redis, self.queues)


def queue_depths(redis, queues: Queues) -> dict[str, int]:
    """Jobs waiting per queue; a handoff domain's queue counts with the queue it stands in for, and every worker's
    own queue (affinity: gradsvc/broker/affinity.py) with the others under `<prefix>-own`. Two round trips: the
    queues RQ knows, then their lengths."""
    shared, domain, prefix = queues.shared, queues.domain, queues.prefix
    own_head = keys.rq_queue_key(keys.own_queue_name(prefix, ""))
    own = sorted(k for k in (m.decode() if isinstance(m, bytes) else m
                             for m in redis.smembers(Queue.redis_queues_keys)) if k.startswith(own_head))
    pipe = redis.pipeline(transaction=False)
    for d, q in shared.items():
        pipe.llen(q.key)
        if d in domain:
            pipe.llen(domain[d].key)
    for key in own:
        pipe.llen(key)
    counts = iter(pipe.execute())
    depths = {q.name: next(counts) + (next(counts) if d in domain else 0) for d, q in shared.items()}
    depths[keys.own_queue_name(prefix, "").rstrip(":")] = sum(counts)
    return depths


async def _shard_progress(aredis, shard_ids: list[str]) -> tuple[int, bool, list[tuple[str, bytes | None]],
                                                                list[str]]:
    """(shards finished, any started, [(origin, last_heartbeat) of each running shard], [failed shard ids]),
    in one round trip."""
    pipe = aredis.pipeline(transaction=False)
    for sid in shard_ids:
        pipe.hmget(Job.key_for(sid), ("status", "origin", "last_heartbeat"))
    rows = await pipe.execute()
    done = sum(1 for status, _, _ in rows if status == b"finished")
    running = [(origin.decode(), beat) for status, origin, beat in rows if status == b"started" and origin]
    failed = [sid for sid, (status, _, _) in zip(shard_ids, rows) if status == b"failed"]
    return done, bool(running) or done > 0, running, failed
