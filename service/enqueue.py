"""Putting a job on the queue: a plain job (to the shared queue, the own queue of the worker that holds its model
(gradsvc/broker/affinity.py), or the handoff domain's with its body as a file), a sharded one (service/fan_out.py),
each once per Idempotency-Key (service/idempotency.py)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import anyio.to_thread
from redis.exceptions import WatchError
from rq import Queue, Worker

from gradsvc.broker import affinity
from gradsvc.broker import handoff as handoff_files
from gradsvc.broker import keys
from gradsvc.broker.connection import send_async
from gradsvc.broker.job import GRADIENT_JOB
from gradsvc.broker.record import JobMeta
from gradsvc.engine.prepare import Prepared
from gradsvc.wire import GradientRequest, Options

from . import fan_out, recent
from .exceptions import ServiceError
from .idempotency import IdempotencyClaims, body_digest, claim_value, still_pending
from .job_write import JobTemplate
from .queues import JobRecord, Queues

log = logging.getLogger("gradsvc.api")
# With Sentinel, how long an enqueue waits for a replica to acknowledge the job (then it goes on, logged).
REPLICA_WAIT_S = 0.5


@dataclass(eq=False)
class Early:
    """What a large body's enqueue starts before the request is checked, to run meanwhile: its handoff file
    (when the job will go through the handoff domain's queue as one job) and its Idempotency-Key digest."""

    staged: handoff_files.Staged | None = None
    digest: "Future[str] | None" = None


@dataclass(eq=False, slots=True)
class JobRequest:
    """What a job to enqueue is: its body as sent (`fmt`: "json" or "msgpack") for `owner`, and what its
    enqueue decides by. `key`, `key_age_s`: its Idempotency-Key and a retry's Idempotency-Key-Age, the
    seconds since the SDK first sent the key (IdempotencyClaims.claim). `sharded`: (request, prepared on
    meta) when options.shards may split the batch (service/fan_out.py). `result_bytes`: what its gradients
    alone will take (a large result is handed back as a file when the job goes through the handoff domain's
    queue, whatever its body's size). `early`: what Enqueuer.start began for this body (its handoff file is
    committed by the enqueue if the job takes it). `model_key`: what a worker holding the job's model knows it by
    (affinity.model_key; None: no affinity), and `pinned`: the job stays in its holder's own queue as long as that
    worker lives (a session's step). `fallback`: set by the enqueue when the job goes to an own queue."""

    body: bytes
    fmt: str
    owner: str
    device: str = "auto"
    key: str | None = None
    key_age_s: float | None = None
    sharded: tuple[GradientRequest, Prepared] | None = None
    result_bytes: int = 0
    early: Early | None = None
    model_key: str | None = None
    pinned: bool = False
    fallback: str | None = None


_UNMADE = object()  # Enqueuer._template before its first job


@dataclass(eq=False)
class Enqueuer:
    """A checked request onto its queue: the idempotency claim, the job record, shards, the pinned queue."""

    queues: Queues
    claims: IdempotencyClaims
    record: JobRecord
    min_shard_rows: int
    digests: Executor | None = None  # the threads a large body's digest runs on (create_app's); None: inline
    _warned_at: float = float("-inf")  # when _replica_acked last logged (time.monotonic())
    _template: JobTemplate | None | object = _UNMADE  # plain_commands' (made at its first job)

    def start(self, body: bytes, options: Options, idempotency_key: str | None, recycled: bool = False) -> Early | None:
        """The enqueue's slow parts begun on threads, for a body large enough to hand off: writing its file
        (written while the meta check runs, which would otherwise come first: 12-19 ms for 12.7 MB) and the
        digest. None for a smaller body. The caller discards what the enqueue did not use. The body goes
        into the spare's pages; `recycled`: the request's release gave the spare a result's file (its client
        releases: its next request brings another), so no spare is made after it."""
        queues = self.queues
        if queues.handoff is None or not queues.handoff.wanted(len(body)):
            return None
        digest = body_digest(body, self.digests) if idempotency_key is not None else None
        handed = options.shards == 1 and queues.handoff_ok(options.device)
        staged = queues.handoff.stage(body, queues.spare, refill=not recycled) if handed else None
        return Early(staged=staged, digest=digest)

    def enqueue(self, body: bytes, fmt: str, device: str, owner: str, idempotency_key: str | None = None,
                sharded: tuple[GradientRequest, Prepared] | None = None) -> tuple[str, bool]:
        """enqueue_job() of a JobRequest made of these (a bench or a test enqueues without HTTP)."""
        return self.enqueue_job(JobRequest(body, fmt, owner, device, key=idempotency_key, sharded=sharded))

    def enqueue_job(self, job: JobRequest) -> tuple[str, bool]:
        """(job id, whether it was enqueued now). A key this owner used within GRADSVC_IDEMPOTENCY_TTL_S
        names the job it enqueued then, which is returned instead of enqueueing the same body again."""
        self._check_device(job.device)
        job_id = self.queues.epochs.new_job_id()
        claim = self.claims.key(job.owner, job.key) if job.key is not None else None
        digest = None
        if claim is not None:
            early = job.early.digest if job.early is not None else None
            digest = early if early is not None else body_digest(job.body, self.digests)
        if job.sharded is not None:
            count = self._shard_count(job)
            if count > 1:
                return self._enqueue_sharded(job, job_id, count, claim, digest)
        return self._enqueue_one(job, job_id, claim, digest)

    def _check_device(self, device: str) -> None:
        if device == "auto":
            return
        queue = self.queues.shared[device]
        if not Worker.all(queue=queue):
            # A job for a device no worker serves would stay queued forever.
            raise ServiceError("device_unavailable", f"no live worker serves device {device!r} (queue "
                               f"{queue.name!r}); use options.device='auto' or start a {device} "
                               "worker", device=device)

    def _shard_count(self, job: JobRequest) -> int:
        req, prep = job.sharded
        shared = self.queues.shared[job.device]
        return fan_out.shard_count(req.options.shards, prep.inputs.rows, lambda: len(Worker.all(queue=shared)),
                                   self.min_shard_rows)

    def _enqueue_sharded(self, job: JobRequest, job_id: str, count: int, claim: str | None,
                         digest: "Future[str] | None") -> tuple[str, bool]:
        """The shard jobs and their reduce job (service/fan_out.py). A key's claim is made as enqueued at
        once (the shards go in several transactions), and released if nothing was enqueued, so that a retry
        under the same key enqueues it."""
        if claim is not None:
            earlier = self.claims.claim(claim, job_id, digest.result(), job.key_age_s, pending=False)
            if earlier is not None:
                return earlier, False
        try:
            self._fan_out(job, job_id, count)
        except BaseException:
            if claim is not None:
                self.claims.release(claim)
            raise
        return job_id, True

    def _enqueue_one(self, job: JobRequest, job_id: str, claim: str | None,
                     digest: "Future[str] | None") -> tuple[str, bool]:
        """One job: to the queue _placed() chose, under the key's claim when there is one, then, with
        Sentinel, acknowledged by a replica."""
        queue, ref = self._placed(job, job_id)
        arg = job.body if ref is None else ref
        try:
            if claim is not None:  # the body's file is written: the digest was computed meanwhile
                earlier = self.claims.claim(claim, job_id, digest.result(), job.key_age_s)
                if earlier is None:
                    earlier = self._enqueue_claimed(claim, claim_value(job_id, digest.result()), queue, arg, job,
                                                    job_id)
                if earlier is not None:
                    if ref is not None:
                        self.queues.handoff.delete(ref)
                    return earlier, False
            else:
                with self.queues.redis.pipeline() as pipe:  # one round trip: RQ alone makes two (registry, then the job)
                    self._enqueue_plain(pipe, queue, arg, job, job_id)
                    pipe.execute()
        except BaseException:
            if ref is not None:
                self.queues.handoff.delete(ref)
            raise
        if self.queues.replicated:  # after the claim is kept: a failed WAIT must not free the key
            with self.queues.redis.pipeline(transaction=False) as pipe:
                self._replica_acked(self._wait_for_replica(pipe).execute())
        return job_id, True

    def _placed(self, job: JobRequest, job_id: str) -> tuple[Queue, str | None]:
        """The job's queue, and its body's handoff file's ref when the job carries that rather than the body.
        The job goes to the domain's queue when its body or result is large (its result comes back as a
        file), its body, when large, as a file too."""
        queues, device, body = self.queues, job.device, job.body
        if not queues.handoff_wanted(device, len(body), job.result_bytes):
            return self._routed(job, queues.shared[device]), None
        if not queues.handoff.wanted(len(body)):
            return queues.domain[device], None
        staged = job.early.staged if job.early is not None else None
        try:
            ref = (staged.commit(job_id, handoff_files.INPUT) if staged is not None
                   else queues.handoff.put(job_id, handoff_files.INPUT, body))
        except OSError as exc:  # the tmpfs is full: Redis still takes it
            log.warning("handoff of a %d-byte body failed (%s); it goes through Redis", len(body), exc)
            ref = None
        return queues.domain[device], ref

    def _routed(self, job: JobRequest, shared: Queue) -> Queue:
        """The own queue of the live worker that holds the job's model, else `shared` (affinity.route). A job whose
        body or result goes through the handoff domain is not routed: its queue is the domain's."""
        if job.model_key is None:
            return shared
        name = affinity.route(self.queues.redis, self.queues.prefix, job.owner, job.model_key, shared.name)
        if name == shared.name:
            return shared
        job.fallback = shared.name
        return self.queues.own(name)

    def _enqueue_claimed(self, claim: str, value: str, queue: Queue, arg: bytes | str, job: JobRequest,
                         job_id: str) -> str | None:
        """Enqueues the job and marks its key's claim enqueued in one transaction, unless the claim changed
        since (a retry took it over, its first attempt having seemed dead): None, or the job the key names now."""
        with self.queues.redis.pipeline() as pipe:
            pipe.watch(claim)  # WATCH, GET, then MULTI/EXEC: one round trip more for a keyed request
            if still_pending(pipe.get(claim), value):
                pipe.multi()
                self._enqueue_plain(pipe, queue, arg, job, job_id)
                pipe.set(claim, value, ex=self.claims.ttl_s)
                try:
                    pipe.execute()
                    return None
                except WatchError:
                    pass
        now = self.queues.redis.get(claim)
        return now.decode().split(" ", 1)[0] if now else job_id

    def _wait_for_replica(self, pipe):
        """With Sentinel: the job just enqueued (its Idempotency-Key's claim too) is on a replica before the
        client is told its id, so a failover that follows loses neither (Redis replicates asynchronously:
        without this the test's failover lost 2 of 40 acknowledged jobs). A write, then WAIT on the same
        connection (`pipe`, executed by the caller; its replies go to _replica_acked)."""
        pipe.incr(keys.replication_mark_key(self.queues.prefix))
        pipe.wait(1, int(REPLICA_WAIT_S * 1000))
        return pipe

    def _replica_acked(self, replies: list) -> None:
        """A replica that did not acknowledge within REPLICA_WAIT_S is logged (once a minute); the answer goes on."""
        if replies[-1] < 1 and time.monotonic() - self._warned_at > 60:
            self._warned_at = time.monotonic()
            log.warning("no Redis replica acknowledged a job within %.1f s: a failover now could lose the jobs "
                        "of the last moments (they would read as job_lost)", REPLICA_WAIT_S)

    def _fan_out(self, job: JobRequest, job_id: str, count: int) -> None:
        req, prep = job.sharded
        cut = fan_out.split(req, prep, count)
        # Each shard returns gradients of the whole model (its result), however few its rows.
        via_handoff = self.queues.handoff_wanted(job.device, max(len(b) for b in cut.bodies), prep.gradient_bytes)
        queue = (self.queues.domain if via_handoff else self.queues.shared)[job.device]
        fan_out.enqueue(queue, self.queues.handoff if via_handoff else None, cut, self.record, job.owner, job_id)

    async def enqueue_async(self, job: JobRequest) -> str:
        """enqueue_job() of a plain job to the shared queue, over the async connection: the job's commands
        (plain_commands) go to Redis in one MULTI/EXEC from the event loop (`send_async`: their replies are not
        needed, only their errors)."""
        queues = self.queues
        job_id = await self.new_job_id()
        await send_async(queues.aredis, self.plain_commands(job, job_id), transaction=True)
        if queues.replicated:
            self._replica_acked(await self._wait_for_replica(queues.aredis.pipeline(transaction=False)).execute())
        return job_id

    async def new_job_id(self) -> str:
        epochs = self.queues.epochs
        job_id = epochs.current and epochs.new_job_id()
        return job_id or await anyio.to_thread.run_sync(epochs.new_job_id)

    def plain_commands(self, job: JobRequest, job_id: str) -> list[tuple]:
        """What enqueue_async sends, as a transaction's commands: RQ's record of a plain job on the shared queue
        (service/job_write.py's template, else RQ's own enqueue into a pipeline never executed) and the owner's
        recent-jobs index."""
        queue, record = self.queues.shared["auto"], self.record
        if self._template is _UNMADE:
            self._template = JobTemplate.of(queue, record.timeout_s, record.result_ttl_s, record.failure_ttl_s)
        if self._template is None or job.fallback is not None or job.pinned:
            recorder = self.queues.redis.pipeline()
            self._enqueue_plain(recorder, queue, job.body, job, job_id)
            commands, recorder.command_stack = recorder.command_stack, []
            return [args for args, _ in commands]
        return [*self._template.commands(job_id, job.body, job.fmt, job.owner),
                *recent.commands(record.prefix, job.owner, job_id, record.index_ttl_s)]

    def _enqueue_plain(self, pipe, queue: Queue, arg: bytes | str, job: JobRequest, job_id: str) -> None:
        """RQ's enqueue of one gradient job (its argument: the body, or its handoff ref) into `pipe`."""
        record = self.record
        queue.enqueue(
            GRADIENT_JOB, arg, job.fmt,
            job_id=job_id,
            job_timeout=record.timeout_s,
            result_ttl=record.result_ttl_s,
            failure_ttl=record.failure_ttl_s,
            meta=JobMeta(owner=job.owner, pinned=job.pinned and job.fallback is not None).as_meta(),
            description="gradients",
            pipeline=pipe,
        )
        if job.fallback is not None and queue.name != job.fallback:  # in a worker's own queue: tracked to move
            self.queues.mover.track(pipe, job_id, job.fallback, record.affinity_wait_s, pinned=job.pinned)
        recent.record(pipe, record.prefix, job.owner, job_id, record.index_ttl_s)
