"""The API's side of the queue: enqueue through RQ, wait on RQ's results stream, read job state."""

from __future__ import annotations

import base64
import hashlib
import logging
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone

import anyio
import anyio.to_thread
import msgspec
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError
from redis.retry import Retry
from rq import Queue, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.utils import utcparse

from gradsvc.broker import handoff as handoff_files
from gradsvc.broker import keys
from gradsvc.broker.handoff import Handoff, HandoffError
from gradsvc.runtime.settings import Settings
from gradsvc.wire import ErrorInfo, GradientResult, JobInfo, Progress
from gradsvc.broker.connection import connect, connect_async
from gradsvc.broker.fanin import cancel_shards, settle
from gradsvc.broker.jobs import GradientJob, MsgpackSerializer
from gradsvc.broker.leases import LeaseRegistry, lease_s
from workers.jobs import gradient_job

from . import recent, shards
from .epochs import Epochs
from .errors import ServiceError

log = logging.getLogger("gradsvc.api")
# An Idempotency-Key's body digest (SHA-256, which releases the GIL) is computed in a thread of its own for
# a large body, while the enqueue writes the body's handoff file: 20 ms of a 36 MB request here, hidden.
_DIGEST_INLINE_BYTES = 1 << 20
_digests = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gradsvc-digest")


def _body_digest(body: bytes) -> "Future[str]":
    if len(body) < _DIGEST_INLINE_BYTES:
        done: Future[str] = Future()
        done.set_result(hashlib.sha256(body).hexdigest())
        return done
    return _digests.submit(lambda: hashlib.sha256(body).hexdigest())


_STATUS = {"created": "queued", "deferred": "queued", "scheduled": "queued", "queued": "queued",
           "started": "started", "finished": "finished", "failed": "failed", "stopped": "canceled",
           "canceled": "canceled"}
_result_decoder = msgspec.msgpack.Decoder(GradientResult)
_FIELDS = ("status", "meta", "enqueued_at", "started_at", "ended_at", "origin", "last_heartbeat")
_JOB_LOST = {"code": "job_lost", "message": "Redis lost this job's record (it was restarted without its data); whether "
             "the job ran is unknown and its result, if any, is gone; submit it again", "detail": {}}
_WORKER_LOST = {"code": "worker_lost", "message": "the worker running this job was lost (killed, crashed, or cut off "
                "from Redis) before it finished; submit it again", "detail": {}}


# An open wait looks for a lapsed lease this often (one HMGET), between blocking reads.
LEASE_CHECK_S = 1.0
# An Idempotency-Key's claim until its job is enqueued ("<job id> <body digest> pending"); then "<job id> <digest>".
_PENDING = "pending"
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0
"""


def _claim_value(job_id: str, digest: str) -> str:
    return f"{job_id} {digest}"


# With Sentinel, how long an enqueue waits for a replica to acknowledge the job (then it goes on, logged).
REPLICA_WAIT_S = 0.5
# How long the API trusts its last look at which workers serve a queue (whether all are in its domain).
ROUTE_CACHE_S = 1.0


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
        self.redis = connect(settings, socket_connect_timeout=timeout, socket_timeout=timeout,
                             retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self.aredis = connect_async(settings, socket_connect_timeout=timeout, socket_timeout=timeout,
                                    retry=AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        # Blocking XREADs last up to max_wait_s, so they get their own pool whose socket timeout outlasts them;
        # wait() bounds each one by its own deadline, so a hung Redis still answers 503 soon after it.
        self.ablocking = connect_async(settings, socket_connect_timeout=timeout,
                                       socket_timeout=settings.max_wait_s + timeout + 5,
                                       retry=AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self.lease_s = lease_s(settings.worker_heartbeat_s)
        self.queues = {d: Queue(keys.queue_name(self.prefix, d), connection=self.redis, serializer=MsgpackSerializer,
                                job_class=GradientJob)
                       for d in keys.QUEUE_DEVICES}
        # GRADSVC_HANDOFF_DIR: large bodies go to a file and their jobs to this domain's queues
        # (gradsvc/broker/handoff.py), as long as every live worker of the device drains them.
        self.handoff: Handoff | None = handoff_files.open_dir(settings.handoff_dir, settings.handoff_min_bytes)
        handoff_files.install(self.handoff)  # for a shard's failure callback run by this process (a reap)
        self.domain_queues = {} if self.handoff is None else {
            d: Queue(keys.domain_queue_name(self.prefix, d, self.handoff.domain), connection=self.redis,
                     serializer=MsgpackSerializer, job_class=GradientJob) for d in keys.QUEUE_DEVICES}
        self._routes: dict[str, tuple[float, bool]] = {}
        self.index_ttl_s = max(settings.result_ttl_s, settings.failure_ttl_s)
        self.epochs = Epochs(self.redis, self.prefix)
        self._replica_warned = float("-inf")

    async def close(self) -> None:
        await self.aredis.aclose()
        await self.ablocking.aclose()
        self.redis.close()

    def enqueue(self, body: bytes, fmt: str, device: str, owner: str, idempotency_key: str | None = None,
                sharded=None, result_bytes: int = 0, key_age_s: float | None = None) -> tuple[str, bool]:
        """(job id, whether it was enqueued now). A key this owner used within GRADSVC_IDEMPOTENCY_TTL_S
        names the job it enqueued then, which is returned instead of enqueueing the same body again.
        `sharded`: (request, prepared on meta) when options.shards may split the batch (service/shards.py).
        `result_bytes`: what its gradients alone will take (a large result is handed back as a file when
        the job goes through the handoff domain's queue, whatever its body's size). `key_age_s`: a retry's
        Idempotency-Key-Age, the seconds since the SDK first sent this key (see _claim)."""
        if device != "auto" and not Worker.all(queue=self.queues[device]):
            # A job for a device no worker serves would stay queued forever.
            raise ServiceError("device_unavailable", f"no live worker serves device {device!r} (queue "
                               f"{self.queues[device].name!r}); use options.device='auto' or start a {device} worker",
                               device=device)
        job_id = self.epochs.new_job_id()
        claim = keys.idempotency_key(self.prefix, owner, idempotency_key) if idempotency_key is not None else None
        digest = _body_digest(body) if claim is not None else None
        ref = None
        claimed = False
        try:
            if sharded is not None:
                req, prep = sharded
                count = shards.shard_count(req.options.shards, prep.inputs.rows,
                                           lambda: len(Worker.all(queue=self.queues[device])),
                                           self.settings.min_shard_rows)
                if count > 1:
                    if claim is not None:  # claimed as enqueued: the shards go in several transactions
                        earlier = self._claim(claim, job_id, digest.result(), key_age_s, pending=False)
                        if earlier is not None:
                            return earlier, False
                        claimed = True
                    return shards.enqueue(self, req, prep, count, device, owner, job_id=job_id), True
            queue, arg = self.queues[device], body
            if self.handoff_wanted(device, len(body), result_bytes):
                # The job goes to the domain's queue (its result comes back as a file), its body, when
                # large, as a file too: the job carries the file's ref.
                queue = self.domain_queues[device]
                if self.handoff.wanted(len(body)):
                    try:
                        ref = self.handoff.put(job_id, handoff_files.INPUT, body)
                    except OSError as exc:  # the tmpfs is full: Redis still takes it
                        log.warning("handoff of a %d-byte body failed (%s); it goes through Redis", len(body), exc)
                    else:
                        arg = ref
            earlier = None
            if claim is not None:  # the body's file is written: the digest was computed meanwhile
                earlier = self._claim(claim, job_id, digest.result(), key_age_s)
                if earlier is None:
                    earlier = self._enqueue_claimed(claim, _claim_value(job_id, digest.result()), queue, arg, fmt,
                                                    owner, job_id)
                if earlier is not None:
                    if ref is not None:
                        self.handoff.delete(ref)
                    return earlier, False
            else:
                with self.redis.pipeline() as pipe:  # one round trip: RQ alone makes two (registry, then the job)
                    self._enqueue_plain(pipe, queue, arg, fmt, owner, job_id)
                    pipe.execute()
        except BaseException:
            if ref is not None:
                self.handoff.delete(ref)
            if claimed:  # a sharded job's claim, nothing enqueued: a retry under the same key must enqueue it
                try:
                    self.redis.delete(claim)
                except (RedisConnectionError, RedisTimeoutError):
                    pass
            raise
        if self.settings.redis_sentinels:  # after the claim is kept: a failed WAIT must not free the key
            with self.redis.pipeline(transaction=False) as pipe:
                self._replica_acked(self._wait_for_replica(pipe).execute())
        return job_id, True

    async def enqueue_async(self, body: bytes, fmt: str, owner: str) -> str:
        """enqueue() of a plain job to the shared queue, over the async connection: RQ writes the job into a
        pipeline that is never executed, and its commands go to Redis in one MULTI/EXEC from the event loop."""
        job_id = self.epochs.current and self.epochs.new_job_id()
        if not job_id:
            job_id = await anyio.to_thread.run_sync(self.epochs.new_job_id)
        recorder = self.redis.pipeline()
        self._enqueue_plain(recorder, self.queues["auto"], body, fmt, owner, job_id)
        commands, recorder.command_stack = recorder.command_stack, []
        pipe = self.aredis.pipeline(transaction=True)
        for args, options in commands:
            pipe.execute_command(*args, **options)
        await pipe.execute()
        if self.settings.redis_sentinels:
            self._replica_acked(await self._wait_for_replica(self.aredis.pipeline(transaction=False)).execute())
        return job_id

    def _wait_for_replica(self, pipe):
        """With Sentinel: the job just enqueued (its Idempotency-Key's claim too) is on a replica before the
        client is told its id, so a failover that follows loses neither (Redis replicates asynchronously:
        without this the test's failover lost 2 of 40 acknowledged jobs). A write, then WAIT on the same
        connection (`pipe`, executed by the caller; its replies go to _replica_acked)."""
        pipe.incr(keys.replication_mark_key(self.prefix))
        pipe.wait(1, int(REPLICA_WAIT_S * 1000))
        return pipe

    def _replica_acked(self, replies: list) -> None:
        """A replica that did not acknowledge within REPLICA_WAIT_S is logged (once a minute); the answer goes on."""
        if replies[-1] < 1 and time.monotonic() - self._replica_warned > 60:
            self._replica_warned = time.monotonic()
            log.warning("no Redis replica acknowledged a job within %.1f s: a failover now could lose the jobs "
                        "of the last moments (they would read as job_lost)", REPLICA_WAIT_S)

    def _enqueue_plain(self, pipe, queue: Queue, arg: bytes | str, fmt: str, owner: str, job_id: str) -> None:
        """RQ's enqueue of one gradient job (its argument: the body, or its handoff ref) into `pipe`."""
        queue.enqueue(
            gradient_job, arg, fmt,
            job_id=job_id,
            job_timeout=self.settings.job_timeout_s,
            result_ttl=self.settings.result_ttl_s,
            failure_ttl=self.settings.failure_ttl_s,
            meta={"owner": owner},
            description="gradients",
            pipeline=pipe,
        )
        recent.record(pipe, self.prefix, owner, job_id, self.index_ttl_s)

    def large_result(self, result_bytes: int) -> bool:
        """Whether a job with a result this large may be handed off (then it is enqueued from a thread, since
        deciding reads Redis: handoff_ok)."""
        return self.handoff is not None and self.handoff.wanted(result_bytes)

    def handoff_wanted(self, device: str, body_bytes: int, result_bytes: int) -> bool:
        """Whether a job goes through the handoff domain's queue: the handoff is on, its body or its result
        is large enough, and every live worker of the device is in the domain."""
        return (self.handoff is not None and (self.handoff.wanted(body_bytes) or self.handoff.wanted(result_bytes))
                and self.handoff_ok(device))

    def handoff_ok(self, device: str) -> bool:
        """Whether every live worker that drains `device`'s queue drains this domain's twin of it too, so a
        job sent there starves no one: RQ's per-queue worker sets, one round trip (a second one only when
        they differ, to skip workers that died without unregistering), trusted for ROUTE_CACHE_S."""
        now = time.monotonic()
        cached = self._routes.get(device)
        if cached is not None and cached[0] > now:
            return cached[1]
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(keys.rq_queue_workers_key(self.queues[device].name))
            pipe.smembers(keys.rq_queue_workers_key(self.domain_queues[device].name))
            plain, domain = pipe.execute()
        others = sorted(plain - domain)
        if others:  # workers outside the domain, or entries of dead ones: count only those alive
            with self.redis.pipeline(transaction=False) as pipe:
                for worker_key in others:
                    pipe.exists(worker_key)
                others = [k for k, alive in zip(others, pipe.execute()) if alive]
        ok = bool(domain) and not others
        self._routes[device] = (now + ROUTE_CACHE_S, ok)
        return ok

    def sweep_handoff(self) -> int:
        """Deletes the handoff files that outlived their TTL (gradsvc.broker.handoff.sweep_ages); the app runs it
        once a minute in a thread, as each worker does after its jobs."""
        if self.handoff is None:
            return 0
        return self.handoff.sweep(handoff_files.sweep_ages(self.settings.result_ttl_s, self.settings.failure_ttl_s))

    async def load_result(self, raw: bytes | None, job_id: str) -> bytes | None:
        """A result key's value as the result's bytes: as stored, or read (in a thread) from the handoff file
        its marker names; None once either has expired."""
        if not handoff_files.is_marker(raw):
            return raw
        try:
            return await anyio.to_thread.run_sync(handoff_files.load, raw, self.handoff)
        except HandoffError as exc:
            # Handoff on behind a balancer over several hosts: each API reads only its own host's files.
            raise ServiceError("internal_error", f"the result of job {job_id} is a file this API cannot read ({exc}); "
                               "GRADSVC_HANDOFF_DIR must be off where several API hosts share one Redis",
                               job_id=job_id) from None

    def _enqueue_claimed(self, claim: str, value: str, queue: Queue, arg: bytes | str, fmt: str, owner: str,
                         job_id: str) -> str | None:
        """Enqueues the job and marks its key's claim enqueued in one transaction, unless the claim changed
        since (a retry took it over, its first attempt having seemed dead): None, or the job the key names now."""
        with self.redis.pipeline() as pipe:
            pipe.watch(claim)  # WATCH, GET, then MULTI/EXEC: one round trip more for a keyed request
            if pipe.get(claim) == f"{value} {_PENDING}".encode():
                pipe.multi()
                self._enqueue_plain(pipe, queue, arg, fmt, owner, job_id)
                pipe.set(claim, value, ex=self.settings.idempotency_ttl_s)
                try:
                    pipe.execute()
                    return None
                except WatchError:
                    pass
        now = self.redis.get(claim)
        return now.decode().split(" ", 1)[0] if now else job_id

    def _claim(self, claim: str, job_id: str, digest: str, key_age_s: float | None = None,
               pending: bool = True) -> str | None:
        """Binds the key to `job_id` (None), or returns the job an earlier request bound it to. A retry
        (`key_age_s`) whose key is unknown while Redis's data is younger than the key was first sent may
        have had its record lost with that data: refused `job_lost` rather than run a second time.
        `pending`: the claim reads as such until _enqueue_claimed's transaction enqueues the job; a retry
        that finds it pending (the first attempt failed, or its API died, between claiming and enqueueing)
        takes it over and enqueues, where it would otherwise be told of a job that never existed."""
        value = _claim_value(job_id, digest)
        mine = f"{value} {_PENDING}" if pending else value
        for _ in range(3):  # an earlier claim can expire between SET NX and GET: claim again
            if self.redis.set(claim, mine, nx=True, ex=self.settings.idempotency_ttl_s):
                if key_age_s is not None and self.epochs.began_within(key_age_s):
                    self.redis.delete(claim)
                    raise ServiceError("job_lost", f"this retry's Idempotency-Key was first sent {key_age_s:.1f} s "
                                       "ago, and Redis may have lost data since (restarted empty, or without its last "
                                       "writes, or failed over): whether the first "
                                       "attempt's job ran is unknown, so it is not run again; submit it with a new "
                                       "key if it should run", header="Idempotency-Key")
                return None
            earlier = self.redis.get(claim)
            if earlier is None:
                continue
            earlier_id, earlier_digest, *state = earlier.decode().split(" ")
            if earlier_digest == digest and state and pending:  # never enqueued: this request takes it over
                if self.redis.eval(_TAKE_OVER, 1, claim, earlier, mine, self.settings.idempotency_ttl_s):
                    return None
                continue
            if earlier_digest != digest:
                raise ServiceError("bad_request", "Idempotency-Key was used for a different request body within "
                                   f"GRADSVC_IDEMPOTENCY_TTL_S ({self.settings.idempotency_ttl_s} s), by job "
                                   f"{earlier_id}; send a new key with a new request", header="Idempotency-Key",
                                   job_id=earlier_id)
            return earlier_id
        return None

    async def wait(self, job_id: str, timeout_s: float) -> tuple[bool, bytes | None]:
        """(ended, stored result) once the job has ended within timeout_s. Waits in slices of a second: a
        job whose worker died ends only when someone notices its lapsed lease, and between slices this
        wait does (so an open wait answers worker_lost within the lease, not only when it runs out)."""
        if timeout_s <= 0:
            return False, None
        deadline = anyio.current_time() + timeout_s
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
            with anyio.fail_after(left_s + self.settings.redis_timeout_s):
                pipe = self.ablocking.pipeline(transaction=False)
                pipe.xread({keys.rq_results_stream(job_id): "0-0"}, count=1, block=max(1, int(block_s * 1000)))
                pipe.get(keys.result_key(self.prefix, job_id))
                got, raw = await pipe.execute()
        except (RedisConnectionError, RedisTimeoutError, TimeoutError) as exc:
            raise ServiceError("queue_unavailable", f"the job queue (Redis) stopped answering while waiting for job "
                               f"{job_id} ({type(exc).__name__}); poll GET /jobs/{job_id} once it is back",
                               headers={"Retry-After": "2"}, job_id=job_id) from None
        return bool(got), await self.load_result(raw, job_id) if got else None

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
        if meta_raw is None and await anyio.to_thread.run_sync(self.epochs.is_lost, job_id):
            # No record, or only what a worker wrote after Redis lost it (a heartbeat, an end), for an id an
            # API issued before Redis restarted empty: lost. Its owner went with the record.
            return JobInfo(job_id=job_id, status="failed", error=ErrorInfo(**_JOB_LOST), progress=None, result=None,
                           enqueued_at=None, started_at=None, ended_at=_iso(ended))
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
            result_raw = await self.load_result(result_raw, job_id)
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
            if self.handoff is not None:  # its handed-off body: no worker will read it now
                self.handoff.discard(job_id)
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
        """Jobs waiting per queue; a handoff domain's queue counts with the queue it stands in for."""
        pipe = self.redis.pipeline(transaction=False)
        for d, q in self.queues.items():
            pipe.llen(q.key)
            if d in self.domain_queues:
                pipe.llen(self.domain_queues[d].key)
        counts = iter(pipe.execute())
        return {q.name: next(counts) + (next(counts) if d in self.domain_queues else 0) for d, q in self.queues.items()}
