"""Training sessions in Redis (docs/sessions.md), shared by the API and the workers: each session's record (its
owner, the worker that holds it, where it stands), its last checkpoint (safetensors bytes), the answers of its
steps (by job, and by idempotency key for a retry) and each owner's set of sessions. Everything of a session
expires GRADSVC_SESSION_IDLE_TTL_S after its last use; every write refreshes it. Only the holding worker writes
a record after its creation (its steps run one at a time on that worker), so a write is a plain SET."""

from __future__ import annotations

import time

import msgspec

from gradsvc.wire import SessionCreate, SessionInfo, SessionStepResult

from . import keys

# The session job function, by the dotted path RQ records (the API imports nothing of workers/).
SESSION_JOB = "workers.session_jobs.session_job"
OPS = ("create", "step", "forward_backward", "optim_step", "weights", "delete")


class SessionRecord(msgspec.Struct, omit_defaults=True):
    """What Redis keeps of a session besides its checkpoint. `create`: POST /sessions's body without its
    weights (they are in the checkpoint), to rebuild the model on another worker."""

    owner: str
    create: SessionCreate
    created_at: float
    last_used_at: float
    holder: str = ""
    device: str = ""
    step: int = 0
    accumulated: int = 0
    checkpoint_step: int | None = None
    checkpoint_every: int = 1
    state_bytes: int = 0
    parameter_count: int = 0
    last: SessionStepResult | None = None

    def info(self, session_id: str) -> SessionInfo:
        return SessionInfo(session_id=session_id, step=self.step, accumulated=self.accumulated,
                           optimizer=self.create.optimizer, parameter_count=self.parameter_count,
                           state_bytes=self.state_bytes, device=self.device, worker=self.holder,
                           checkpoint_step=self.checkpoint_step, checkpoint_every=self.checkpoint_every,
                           run=self.create.run, created_at=self.created_at, last_used_at=self.last_used_at,
                           last=self.last)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SessionRecord)


def new_record(owner: str, create: SessionCreate) -> SessionRecord:
    now = time.time()
    return SessionRecord(owner=owner, create=msgspec.structs.replace(
        create, model=msgspec.structs.replace(create.model, weights=None)), created_at=now, last_used_at=now)


class SessionRecords:
    """The sessions' keys over a sync Redis client (the API calls it from a thread, the worker directly)."""

    def __init__(self, redis, prefix: str, ttl_s: int, worker: str = "") -> None:
        self.redis, self.prefix, self.ttl_s = redis, prefix, ttl_s
        self.worker = worker  # on a worker: its name, which a record's holder is compared with

    def get(self, session_id: str) -> SessionRecord | None:
        raw = self.redis.get(keys.training_session_key(self.prefix, session_id))
        return _decoder.decode(raw) if raw else None

    def owned(self, owner: str, session_id: str) -> SessionRecord | None:
        """The record when `owner` owns the session; another key's session reads as none."""
        rec = self.get(session_id)
        return rec if rec is not None and rec.owner == owner else None

    def put(self, session_id: str, rec: SessionRecord, state: bytes | None = None, client=None) -> None:
        """Writes the record (and a checkpoint when given), refreshing the TTL of everything of the session."""
        p, ttl = self.prefix, self.ttl_s
        pipe = client if client is not None else self.redis.pipeline()
        pipe.set(keys.training_session_key(p, session_id), _encoder.encode(rec), ex=ttl)
        if state is not None:
            pipe.set(keys.training_session_state_key(p, session_id), state, ex=ttl)
        else:
            pipe.expire(keys.training_session_state_key(p, session_id), ttl)
        pipe.sadd(keys.training_sessions_key(p, rec.owner), session_id)
        pipe.expire(keys.training_sessions_key(p, rec.owner), ttl)
        if client is None:
            pipe.execute()

    def state(self, session_id: str) -> bytes | None:
        return self.redis.get(keys.training_session_state_key(self.prefix, session_id))

    def live(self, owner: str) -> dict[str, SessionRecord]:
        """The owner's sessions whose record is still there (the others leave the owner's set)."""
        index = keys.training_sessions_key(self.prefix, owner)
        ids = sorted(i.decode() if isinstance(i, bytes) else i for i in self.redis.smembers(index))
        if not ids:
            return {}
        raws = self.redis.mget([keys.training_session_key(self.prefix, i) for i in ids])
        gone = [i for i, raw in zip(ids, raws) if raw is None]
        if gone:
            self.redis.srem(index, *gone)
        return {i: _decoder.decode(raw) for i, raw in zip(ids, raws) if raw is not None}

    def delete(self, owner: str, session_id: str) -> None:
        p = self.prefix
        pipe = self.redis.pipeline()
        pipe.delete(keys.training_session_key(p, session_id), keys.training_session_state_key(p, session_id))
        pipe.srem(keys.training_sessions_key(p, owner), session_id)
        pipe.execute()

    def put_answer(self, session_id: str, key: str, data: bytes, client=None) -> None:
        (client or self.redis).set(keys.training_session_answer_key(self.prefix, session_id, key), data,
                                   ex=self.ttl_s)

    def answer(self, session_id: str, key: str) -> bytes | None:
        return self.redis.get(keys.training_session_answer_key(self.prefix, session_id, key))


def job_answer_name(job_id: str) -> str:
    """The answer key's name for a job's own answer (the API reads it once the job ended)."""
    return f"job {job_id}"
