"""Training sessions from the API's side (docs/sessions.md): a POST /sessions checked before the queue (its model
and weights on meta, the owner's count and byte budget), each operation enqueued as an RQ job for the worker that
holds the session and waited on like a /gradients job, its answer read back; GET and DELETE over the session's
record. The routes (service/session_routes.py) map these outcomes to HTTP."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

import anyio.to_thread
import msgspec

from gradsvc.broker import affinity, keys
from gradsvc.broker.blobs import BlobError, BlobStore
from gradsvc.broker.graphs import GraphStore
from gradsvc.broker.record import JobMeta
from gradsvc.broker.session_records import (OVER_BUDGET, SESSION_JOB, TOO_MANY, SessionRecord, SessionRecords,
                                            job_answer_name, new_record)
from gradsvc.engine import Engine
from gradsvc.engine.session import footprint
from gradsvc.engine.session_state import check_step_values
from gradsvc.engine.tensors import TORCH_DTYPES
from gradsvc.runtime.settings import Settings
from gradsvc.wire import (GradientRequest, SessionBatch, SessionCreate, SessionCreated, SessionInfo, SessionOptimStep,
                          by_reference)

from .exceptions import ServiceError
from .job_reader import JobReader
from .queues import Queues

_created = msgspec.msgpack.Decoder(SessionCreated)
# How many times a call beaten by another worker's commit (session_conflict) is sent again.
CONFLICT_TRIES = 3
# The operations every member of a session over several workers runs (the others go to rank 0, the holder).
GROUP_OPS = ("step", "forward_backward", "optim_step")


@dataclass(frozen=True)
class Operation:
    """One operation to enqueue: its session, name, body (as sent, `fmt`), the session's device queue and the
    call's Idempotency-Key header."""

    session_id: str
    op: str
    body: bytes
    fmt: str
    device: str = "auto"
    key: str | None = None
    holder: str = ""  # the worker holding the session (its own queue takes the job while it lives)
    base: str | None = None  # a create's frozen base (affinity.base_key): a worker holding it takes the job first
    members: tuple[str, ...] = ()  # a session over several workers: a job to each, rank 0 first (its answer read)


@dataclass(frozen=True)
class Answer:
    """An operation's outcome: the worker's answer (MessagePack), or, when it did not end within the wait, the
    job still running (`job_id`: retry the call with the same idempotency key)."""

    data: bytes | None = None
    job_id: str | None = None


@dataclass(eq=False)
class TrainingSessions:
    """The session routes' orchestration: a session's record, its holder's queue, and the answers."""

    settings: Settings
    queues: Queues
    reader: JobReader
    records: SessionRecords
    engine: Engine
    graphs: GraphStore
    blobs: BlobStore

    @classmethod
    def of(cls, settings: Settings, queues: Queues, reader: JobReader, engine: Engine, graphs: GraphStore,
           blobs: BlobStore) -> "TrainingSessions":
        records = SessionRecords(queues.redis, settings.queue_prefix, settings.session_idle_ttl_s)
        return cls(settings, queues, reader, records, engine, graphs, blobs)

    # --- POST /sessions -------------------------------------------------------------------------------------

    async def create(self, owner: str, create: SessionCreate, body: bytes, fmt: str, wait_s: float,
                     key: str | None = None) -> SessionCreated:
        """`key`: the Idempotency-Key; a retry under it answers the session its first try created."""
        earlier = await anyio.to_thread.run_sync(self._created_under, owner, key) if key is not None else None
        if earlier is not None:
            return await self._created(owner, earlier, wait_s)
        members = ()
        if create.options.workers > 1:
            members = await anyio.to_thread.run_sync(self._members, create.options.workers, create.options.device,
                                                     ())
        session_id = await anyio.to_thread.run_sync(self._admit, owner, create)
        if key is not None and not await anyio.to_thread.run_sync(self._claim, owner, key, session_id):
            await anyio.to_thread.run_sync(self.records.delete, owner, session_id)  # a concurrent try won
            return await self._created(owner, await anyio.to_thread.run_sync(self._created_under, owner, key),
                                       wait_s)
        try:
            base = affinity.base_key(create.model.dtype, by_reference(create.model.weights,
                                                                      set(create.options.freeze)))
            answer = await self._run(owner, Operation(session_id, "create", body, fmt, create.options.device,
                                                      base=base, members=members), wait_s)
        except BaseException:
            await anyio.to_thread.run_sync(self.records.delete, owner, session_id)
            raise
        if answer.data is None:
            await anyio.to_thread.run_sync(self.records.delete, owner, session_id)
            raise ServiceError("queue_unavailable", f"no worker built the session within {wait_s:.0f} s (are the "
                               "workers busy?); retry POST /sessions later", headers={"Retry-After": "5"})
        return _created.decode(answer.data)

    def _created_under(self, owner: str, key: str) -> str | None:
        raw = self.queues.redis.get(keys.training_session_created_key(self.settings.queue_prefix, owner, key))
        return raw.decode() if raw else None

    def _claim(self, owner: str, key: str, session_id: str) -> bool:
        return bool(self.queues.redis.set(keys.training_session_created_key(self.settings.queue_prefix, owner, key),
                                          session_id, nx=True, ex=self.settings.idempotency_ttl_s))

    async def _created(self, owner: str, session_id: str, wait_s: float) -> SessionCreated:
        """The answer of the session an earlier try created, once its worker built it (within wait_s)."""
        deadline = anyio.current_time() + wait_s
        while True:
            rec = await anyio.to_thread.run_sync(self.owned, owner, session_id)
            if rec.holder:
                return SessionCreated(session_id=session_id, step=rec.step, parameter_count=rec.parameter_count,
                                      device=rec.device, checkpoint_every=rec.checkpoint_every,
                                      state_bytes=rec.state_bytes)
            if anyio.current_time() > deadline:
                raise ServiceError("queue_unavailable", f"session {session_id}, created by an earlier try under this "
                                   "Idempotency-Key, is still being built; retry", headers={"Retry-After": "2"},
                                   session_id=session_id)
            await anyio.sleep(0.05)

    def _admit(self, owner: str, create: SessionCreate) -> str:
        """Checks the session before the queue (its model on meta, the owner's count and bytes) and writes its
        record, the count and bytes checked and the record written in one step (SessionRecords.admit: two
        concurrent POST /sessions at the limit cannot both get in); answers its id."""
        s = self.settings
        self.blobs.check(owner, GradientRequest(model=create.model, inputs=[]))
        _, held = footprint(create, self.engine.config, self.engine.caches, self.graphs.resolver(owner))
        pieces = self.blobs.held_bytes(owner)
        epochs = self.queues.epochs
        session_id = secrets.token_hex(12) + (epochs.current or epochs.refresh())  # ends in Redis's epoch
        rec = new_record(owner, create)
        rec.state_bytes = held
        verdict, live, used = self.records.admit(owner, session_id, rec, s.session_max_per_owner,
                                                 s.tensor_budget_bytes - pieces)
        if verdict == TOO_MANY:
            raise ServiceError("too_many_sessions", f"this API key holds {len(live)} training sessions, the most "
                               f"GRADSVC_SESSION_MAX_PER_OWNER={s.session_max_per_owner} allows; delete one you no "
                               "longer use (DELETE /sessions/{id}) or wait for an idle one to expire "
                               f"(GRADSVC_SESSION_IDLE_TTL_S={s.session_idle_ttl_s})", limit=s.session_max_per_owner,
                               sessions=live)
        if verdict == OVER_BUDGET:
            used += pieces
            raise ServiceError("too_many_sessions", f"this session would hold {held} bytes; with the {used} bytes this "
                               "API key's sessions and uploaded tensors hold, that is over GRADSVC_TENSOR_BUDGET_BYTES="
                               f"{s.tensor_budget_bytes}; delete a session, or train a smaller model (or fewer "
                               "parameters: options.freeze)", bytes=held, used=used, limit=s.tensor_budget_bytes)
        return session_id

    # --- operations ----------------------------------------------------------------------------------------

    def owned(self, owner: str, session_id: str) -> SessionRecord:
        rec = self.records.owned(owner, session_id)
        if rec is None and self.queues.epochs.is_lost(session_id):
            raise ServiceError("session_lost", f"Redis lost session {session_id!r} (it was restarted without its "
                               "data): its record and checkpoint are gone; create a new session from your last "
                               "weights (POST /sessions)", session_id=session_id)
        if rec is None:
            raise ServiceError("not_found", f"no session {session_id!r} for this API key: it never existed, was "
                               "deleted, belongs to another key, or went unused for longer than "
                               f"GRADSVC_SESSION_IDLE_TTL_S={self.settings.session_idle_ttl_s}; create one with "
                               "POST /sessions", session_id=session_id)
        return rec

    async def operate(self, owner: str, call: Operation, wait_s: float,
                      decoded: SessionBatch | SessionOptimStep | None = None) -> Answer:
        """step, forward_backward, forward, optim_step, weights: checked against the session (`decoded`: the
        body; its lr in the session's dtype, its tensor pieces the owner's), enqueued for the session's worker and
        waited on.
        A call another worker's commit beat (session_conflict: not applied), or one a member of a session over
        several workers failed (member_lost: not applied), is sent again, to the workers holding the session now
        (the members alive), up to CONFLICT_TRIES times."""
        for attempt in range(CONFLICT_TRIES):
            rec = await anyio.to_thread.run_sync(self.owned, owner, call.session_id)
            if decoded is not None and attempt == 0:
                await anyio.to_thread.run_sync(self._check_call, owner, rec, decoded)
            members = ()
            if rec.members and call.op in GROUP_OPS:
                members = await anyio.to_thread.run_sync(self._members, len(rec.members), rec.create.options.device,
                                                         tuple(rec.members))
            try:
                return await self._run(owner, replace(call, device=rec.create.options.device, holder=rec.holder,
                                                      members=members), wait_s)
            except ServiceError as exc:
                if exc.code not in ("session_conflict", "member_lost") or attempt == CONFLICT_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _check_call(self, owner: str, rec: SessionRecord, call: SessionBatch | SessionOptimStep) -> None:
        """The call's lr in the session's dtype and its tensor pieces the owner's; the frozen base's pieces
        touched, so that they live as long as the session is used (a worker restoring it fetches them)."""
        check_step_values(call.lr, TORCH_DTYPES[rec.create.model.dtype])
        bare = msgspec.structs.replace(rec.create.model, weights=None)
        if isinstance(call, SessionBatch):
            self.blobs.check(owner, GradientRequest(model=bare, inputs=call.inputs, targets=call.targets))
        if rec.create.model.weights:
            try:
                self.blobs.check(owner, GradientRequest(model=rec.create.model, inputs=[]))
            except BlobError:  # evicted: the worker holding the session holds the base; a restore would say so
                pass

    async def info(self, owner: str, session_id: str) -> SessionInfo:
        rec = await anyio.to_thread.run_sync(self.owned, owner, session_id)
        return rec.info(session_id)

    async def delete(self, owner: str, session_id: str) -> None:
        """Deletes the record and checkpoint now; the worker holding the session frees it with its next job
        (a delete job, or when it needs the room)."""
        rec = await anyio.to_thread.run_sync(self.owned, owner, session_id)
        await anyio.to_thread.run_sync(self.records.delete, owner, session_id)
        for holder in dict.fromkeys([rec.holder, *rec.members]):  # every worker holding a replica frees it
            if holder:
                await anyio.to_thread.run_sync(self._enqueue, owner, Operation(session_id, "delete", b"", "msgpack",
                                                                               holder=holder))

    async def _run(self, owner: str, call: Operation, wait_s: float) -> Answer:
        session_id, op = call.session_id, call.op
        job_id = await anyio.to_thread.run_sync(self._enqueue, owner, call)
        ended, _ = await self.reader.wait(job_id, wait_s)
        if not ended:
            return Answer(job_id=job_id)
        raw = await self.queues.aredis.getdel(  # read once: an answer (a weights download) is not kept after it
            keys.training_session_answer_key(self.settings.queue_prefix, session_id, job_answer_name(job_id)))
        if raw is not None:
            return Answer(data=raw)
        info = await self.reader.info(job_id, owner, with_result=False)
        error = info.error
        if error is None:
            raise ServiceError("not_found", f"the answer of session {session_id}'s {op} expired before it was read; "
                               "send it again with the same idempotency key", session_id=session_id)
        raise ServiceError(error.code, error.message, **error.detail)

    def _members(self, k: int, device: str, held: tuple[str, ...]) -> tuple[str, ...]:
        """The k workers a session over several is held by: those of `held` (its members now) that are alive, in
        their order, and more of the live workers serving the device's queue; workers_full when fewer than k are
        alive."""
        queues = self.queues
        found = (n.decode() if isinstance(n, bytes) else n
                 for n in queues.redis.smembers(keys.rq_queue_workers_key(queues.shared[device].name)))
        alive = affinity.workers_alive(queues.redis, [n.removeprefix(keys.rq_worker_key("")) for n in found])
        members = [n for n in held if n in alive]
        members += [n for n in sorted(alive, key=lambda n: secrets.randbits(32)) if n not in members]
        if len(members) < k:
            raise ServiceError("workers_full", f"options.workers={k}: {len(alive)} workers serving the {device} "
                               f"queue are alive; start more workers, or ask for at most {len(alive)}",
                               headers={"Retry-After": "5"}, workers=k, alive=len(alive))
        return tuple(members[:k])

    def _enqueue(self, owner: str, call: Operation) -> str:
        """The job to the own queue of the worker holding the session while it lives, pinned there (never moved
        to the shared queue while that worker lives: gradsvc/broker/affinity.py); a create to the own queue of a
        live worker holding its frozen base, for GRADSVC_SESSION_BASE_WAIT_MS; else to the shared queue of the
        session's device, where the worker that takes it restores the session from its checkpoint."""
        if call.members:
            return self._enqueue_members(owner, call)
        queues, s = self.queues, self.settings
        job_id = queues.epochs.new_job_id()
        shared = queues.shared[call.device]
        queue, pinned = shared, False
        if call.holder and affinity.worker_alive(queues.redis, call.holder):
            queue, pinned = queues.own(keys.own_queue_name(s.queue_prefix, call.holder)), True
        elif call.base is not None:  # a new session of a base some worker holds: that worker first, for a while
            name = affinity.route(queues.redis, s.queue_prefix, affinity.BASES, call.base, shared.name)
            queue = shared if name == shared.name else queues.own(name)
        with queues.redis.pipeline() as pipe:
            self._put(pipe, queue, owner, call, job_id, pinned)
            if queue is not shared:
                queues.mover.track(pipe, job_id, shared.name, s.session_base_wait_ms / 1e3, pinned=pinned)
            pipe.execute()
        return job_id

    def _enqueue_members(self, owner: str, call: Operation) -> str:
        """A call of a session over several workers: one job to each member's own queue, pinned, in one
        transaction (every worker sees two sessions' calls in the same order: no two members wait on each other
        crosswise); each job carries the members, its rank and the call's id, rank 0's job id, which is answered."""
        queues, s = self.queues, self.settings
        shared = queues.shared[call.device]
        ids = [queues.epochs.new_job_id() for _ in call.members]
        with queues.redis.pipeline() as pipe:
            for rank, (name, job_id) in enumerate(zip(call.members, ids)):
                group = {"members": list(call.members), "rank": rank, "call": ids[0]}
                self._put(pipe, queues.own(keys.own_queue_name(s.queue_prefix, name)), owner, call, job_id, True,
                          group)
                queues.mover.track(pipe, job_id, shared.name, 0.0, pinned=True)
            pipe.execute()
        return ids[0]

    def _put(self, pipe, queue, owner: str, call: Operation, job_id: str, pinned: bool,
             group: dict | None = None) -> None:
        """The session job of `call` into `queue` in `pipe`, `pinned` to it, with its part of a session over several
        workers (`group`)."""
        s = self.settings
        extra = {"group": group} if group is not None else {}
        queue.enqueue(SESSION_JOB, call.session_id, call.op, call.body, call.fmt, call.key, **extra, job_id=job_id,
                      job_timeout=s.job_timeout_s, result_ttl=s.result_ttl_s, failure_ttl=s.failure_ttl_s,
                      meta=JobMeta(owner=owner, pinned=pinned).as_meta(),
                      description=f"session {call.op}" + (f" ({group['rank']})" if group else ""), pipeline=pipe)
