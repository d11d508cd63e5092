"""The API's side of the queue: enqueue through RQ, wait on RQ's results stream, read job state."""

from __future__ import annotations

import base64
import zlib
from datetime import datetime, timezone

import anyio
import anyio.to_thread
import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from rq import Queue, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.utils import utcparse

from gradsvc import keys
from gradsvc.settings import Settings
from gradsvc.wire import ErrorInfo, GradientResult, JobInfo, Progress
from workers.jobs import GradientJob
from workers.serializer import MsgpackSerializer
from workers.shards import LeaseRegistry, cancel_shards, settle

from . import shards
from .errors import ServiceError

JOB_FUNCTION = "workers.jobs.gradient_job"
_STATUS = {"created": "queued", "deferred": "queued", "scheduled": "queued", "queued": "queued",
           "started": "started", "finished": "finished", "failed": "failed", "stopped": "canceled",
           "canceled": "canceled"}
_result_decoder = msgspec.msgpack.Decoder(GradientResult)
_FIELDS = ("status", "meta", "enqueued_at", "started_at", "ended_at", "origin", "last_heartbeat")
_WORKER_LOST = {"code": "worker_lost", "message": "the worker running this job was lost (killed, crashed, or cut off "
                "from Redis) before it finished; submit it again", "detail": {}}


def _iso(raw: bytes | None) -> str | None:
    return raw.decode() if raw else None


class JobStore:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.prefix = settings.queue_prefix
        # Short timeouts and one immediate retry on a connection error only (never on a timeout): a pooled
        # connection that a Redis restart left dead is replaced at once, and with Redis down or hung the API
        # still answers 503 within about GRADSVC_REDIS_TIMEOUT_S.
        timeout = settings.redis_timeout_s
        self.redis = Redis.from_url(settings.redis_url, socket_connect_timeout=timeout, socket_timeout=timeout,
                                    retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self.aredis = aioredis.from_url(settings.redis_url, socket_connect_timeout=timeout, socket_timeout=timeout,
                                        retry=AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        # Blocking XREADs last up to max_wait_s, so they get their own pool whose socket timeout outlasts them;
        # wait() bounds each one by its own deadline, so a hung Redis still answers 503 soon after it.
        self.ablocking = aioredis.from_url(settings.redis_url, socket_connect_timeout=timeout,
                                           socket_timeout=settings.max_wait_s + timeout + 5,
                                           retry=AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self.lease_s = 3 * settings.worker_heartbeat_s  # as workers.worker.GradientWorker
        self.queues = {d: Queue(keys.queue_name(self.prefix, d), connection=self.redis, serializer=MsgpackSerializer,
                                job_class=GradientJob)
                       for d in keys.QUEUE_DEVICES}

    async def close(self) -> None:
        await self.aredis.aclose()
        await self.ablocking.aclose()
        self.redis.close()

    def enqueue(self, body: bytes, fmt: str, device: str, owner: str, sharded=None) -> str:
        """`sharded`: (request, prepared on meta) when options.shards may split the batch (service/shards.py)."""
        if device != "auto" and not Worker.all(queue=self.queues[device]):
            # A job for a device no worker serves would stay queued forever.
            raise ServiceError("device_unavailable", f"no live worker serves device {device!r} (queue "
                               f"{self.queues[device].name!r}); use options.device='auto' or start a {device} worker",
                               device=device)
        if sharded is not None:
            req, prep = sharded
            count = shards.shard_count(req.options.shards, prep.inputs.shape[0],
                                       lambda: len(Worker.all(queue=self.queues[device])), self.settings.min_shard_rows)
            if count > 1:
                return shards.enqueue(self, req, prep, count, device, owner)
        with self.redis.pipeline() as pipe:  # one round trip: RQ alone makes two (queue registry, then the job)
            job = self.queues[device].enqueue(
                JOB_FUNCTION, body, fmt,
                job_timeout=self.settings.job_timeout_s,
                result_ttl=self.settings.result_ttl_s,
                failure_ttl=self.settings.failure_ttl_s,
                meta={"owner": owner},
                description="gradients",
                pipeline=pipe,
            )
            pipe.execute()
        return job.id

    async def wait(self, job_id: str, timeout_s: float) -> tuple[bool, bytes | None]:
        """(ended, stored result) once the job has ended (RQ appended to its results stream) within
        timeout_s. The result GET rides in the same pipeline as the blocking XREAD: Redis runs it as soon
        as the XREAD returns, so a finished job costs one round trip, not two."""
        if timeout_s <= 0:
            return False, None
        try:
            with anyio.fail_after(timeout_s + self.settings.redis_timeout_s):
                pipe = self.ablocking.pipeline(transaction=False)
                pipe.xread({keys.rq_results_stream(job_id): "0-0"}, count=1, block=max(1, int(timeout_s * 1000)))
                pipe.get(keys.result_key(self.prefix, job_id))
                got, raw = await pipe.execute()
        except (RedisConnectionError, RedisTimeoutError, TimeoutError) as exc:
            raise ServiceError("queue_unavailable", f"the job queue (Redis) stopped answering while waiting for job "
                               f"{job_id} ({type(exc).__name__}); poll GET /jobs/{job_id} once it is back",
                               headers={"Retry-After": "2"}, job_id=job_id) from None
        return bool(got), raw if got else None

    async def info(self, job_id: str, owner: str, *, with_result: bool = True, _reaped: bool = False) -> JobInfo:
        pipe = self.aredis.pipeline(transaction=False)
        pipe.hmget(Job.key_for(job_id), _FIELDS)
        pipe.get(keys.result_key(self.prefix, job_id))
        (status, meta_raw, enqueued, started, ended, origin, beat), result_raw = await pipe.execute()
        if status == b"started" and origin and not _reaped and self._lease_lapsed(beat):
            # No worker renewed this job's lease: fail it now (AbandonedJobError -> worker_lost) rather than
            # wait for a worker's reaper, so a job outlives no worker at all as "started".
            await anyio.to_thread.run_sync(self.reap_abandoned, origin.decode())
            return await self.info(job_id, owner, with_result=with_result, _reaped=True)
        meta = MsgpackSerializer.loads(meta_raw) if meta_raw else {}
        shard_progress = None
        if meta.get("shards") and status in (b"deferred", b"queued", b"started"):
            done, running, leases, failed = await shards.progress(self.aredis, meta["shards"])
            lapsed = {origin for origin, shard_beat in leases if self._lease_lapsed(shard_beat)}
            if (lapsed or (failed and status == b"deferred")) and not _reaped:
                # As above, for a shard: reaped, it fails the job (workers/shards.py); a failed shard whose
                # job still waits had its fan-in cut short: run it again.
                for queue_name in lapsed:
                    await anyio.to_thread.run_sync(self.reap_abandoned, queue_name)
                for shard_id in failed:
                    await anyio.to_thread.run_sync(settle, self.redis, shard_id)
                return await self.info(job_id, owner, with_result=with_result, _reaped=True)
            total = len(meta["shards"])
            shard_progress = ({"phase": "shards", "done": done, "total": total} if done < total else
                              {"phase": "reduce", "done": total, "total": total})
            if running and status in (b"deferred", b"queued"):  # shards running, or all done and reducing next
                status = b"started"
        if status is None or meta.get("owner") != owner:
            # Another key's job reads as unknown: its existence is not disclosed.
            raise ServiceError("not_found", f"no job {job_id!r}; it never existed, belongs to another API key, or "
                               "expired (results are kept GRADSVC_RESULT_TTL_S seconds)", job_id=job_id)
        state = _STATUS.get(status.decode(), "queued")
        error = meta.get("error")
        if error and error.get("code") == "canceled":
            state = "canceled"
        if state == "failed" and not error:
            error = await self._failure_from_rq(job_id)
        result = None
        if state == "finished" and with_result:
            if result_raw is None:
                raise ServiceError("not_found", f"the result of job {job_id!r} has expired", job_id=job_id)
            result = _result_decoder.decode(result_raw)
        progress = shard_progress or meta.get("progress")
        return JobInfo(
            job_id=job_id,
            status=state,
            progress=Progress(**progress) if progress else None,
            error=ErrorInfo(**error) if error else None,
            result=result,
            enqueued_at=_iso(enqueued),
            started_at=_iso(started),
            ended_at=_iso(ended),
        )

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
        self.redis.set(keys.cancel_key(self.prefix, job_id), b"1", ex=self.settings.job_timeout_s + 60)
        if status != "started":
            job.cancel()
            job.meta["error"] = {"code": "canceled", "message": "canceled by DELETE /jobs/{id} before it started",
                                 "detail": {}}
            job.save_meta()
        if job.meta.get("shards"):
            cancel_shards(self.redis, job)  # its shards, queued or running (they poll the flag set above)

    # --- what /readyz and /metrics read from Redis -------------------------------------------------
    def ping(self) -> bool:
        return bool(self.redis.ping())

    def workers(self) -> list[Worker]:
        return Worker.all(connection=self.redis)

    def queue_depths(self) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for q in self.queues.values():
            pipe.llen(q.key)
        return dict(zip((q.name for q in self.queues.values()), pipe.execute()))
