"""Training sessions in Redis (docs/sessions.md), shared by the API and the workers: each session's record (its
owner, the worker that holds it, where it stands), its last checkpoint (safetensors bytes), the answers of its
steps (by job, and by idempotency key for a retry) and each owner's set of sessions. Everything of a session
expires GRADSVC_SESSION_IDLE_TTL_S after its last use; every write refreshes it. Only the holding worker writes
a record after its creation (its steps run one at a time on that worker), so a write is a plain SET. A new
session's record is written by one Lua script that counts the owner's live sessions and their bytes and writes it
only within the limits (admit), so two concurrent POST /sessions at the limit cannot both get in."""

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

# KEYS: the owner's index (session id -> its state bytes), the new record's key. ARGV: the records' key prefix, the
# most sessions, the bytes the sessions may hold together, the new session's id, its bytes, the record, the TTL.
# Drops the index's ids whose record expired; answers {verdict (0 admitted, 1 too many, 2 over the bytes), the
# live ids, the bytes they hold}; writes the record only when admitted. (It reads the other records' keys by
# their prefix, as takes.py reads the jobs': one Redis, no cluster.)
_ADMIT = """
local entries = redis.call('HGETALL', KEYS[1])
local ids, used = {}, 0
for i = 1, #entries, 2 do
  if redis.call('EXISTS', ARGV[1] .. entries[i]) == 1 then
    ids[#ids + 1] = entries[i]
    used = used + tonumber(entries[i + 1])
  else
    redis.call('HDEL', KEYS[1], entries[i])
  end
end
local verdict = 0
if #ids >= tonumber(ARGV[2]) then verdict = 1
elseif used + tonumber(ARGV[5]) > tonumber(ARGV[3]) then verdict = 2 end
if verdict == 0 then
  redis.call('SET', KEYS[2], ARGV[6], 'EX', ARGV[7])
  redis.call('HSET', KEYS[1], ARGV[4], ARGV[5])
  redis.call('EXPIRE', KEYS[1], ARGV[7])
end
return {verdict, ids, string.format('%.0f', used)}
"""
ADMITTED, TOO_MANY, OVER_BUDGET = 0, 1, 2


def new_record(owner: str, create: SessionCreate) -> SessionRecord:
    now = time.time()
    return SessionRecord(owner=owner, create=msgspec.structs.replace(
        create, model=msgspec.structs.replace(create.model, weights=None)), created_at=now, last_used_at=now)


class SessionRecords:
    """The sessions' keys over a sync Redis client (the API calls it from a thread, the worker directly)."""

    def __init__(self, redis, prefix: str, ttl_s: int, worker: str = "") -> None:
        self.redis, self.prefix, self.ttl_s = redis, prefix, ttl_s
        self.worker = worker  # on a worker: its name, which a record's holder is compared with
        self._admit = redis.register_script(_ADMIT)

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
        pipe.hset(keys.training_sessions_key(p, rec.owner), session_id, rec.state_bytes)
        pipe.expire(keys.training_sessions_key(p, rec.owner), ttl)
        if client is None:
            pipe.execute()

    def state(self, session_id: str) -> bytes | None:
        return self.redis.get(keys.training_session_state_key(self.prefix, session_id))

    def admit(self, owner: str, session_id: str, rec: SessionRecord, limit: int,
              budget_bytes: int) -> tuple[int, list[str], int]:
        """Writes a new session's record when the owner holds fewer than `limit` live sessions and their bytes
        plus rec.state_bytes fit `budget_bytes`, in one step (a Lua script). Returns (ADMITTED, TOO_MANY or
        OVER_BUDGET, the ids of the owner's live sessions before it, the bytes they hold)."""
        verdict, ids, used = self._admit(
            keys=[keys.training_sessions_key(self.prefix, owner), keys.training_session_key(self.prefix, session_id)],
            args=[keys.training_session_key(self.prefix, ""), limit, budget_bytes, session_id, rec.state_bytes,
                  _encoder.encode(rec), self.ttl_s])
        return int(verdict), sorted(i.decode() if isinstance(i, bytes) else i for i in ids), int(used)

    def live(self, owner: str) -> dict[str, SessionRecord]:
        """The owner's sessions whose record is still there (the others leave the owner's index)."""
        index = keys.training_sessions_key(self.prefix, owner)
        ids = sorted(i.decode() if isinstance(i, bytes) else i for i in self.redis.hkeys(index))
        if not ids:
            return {}
        raws = self.redis.mget([keys.training_session_key(self.prefix, i) for i in ids])
        gone = [i for i, raw in zip(ids, raws) if raw is None]
        if gone:
            self.redis.hdel(index, *gone)
        return {i: _decoder.decode(raw) for i, raw in zip(ids, raws) if raw is not None}

    def delete(self, owner: str, session_id: str) -> None:
        p = self.prefix
        pipe = self.redis.pipeline()
        pipe.delete(keys.training_session_key(p, session_id), keys.training_session_state_key(p, session_id))
        pipe.hdel(keys.training_sessions_key(p, owner), session_id)
        pipe.execute()

    def put_answer(self, session_id: str, key: str, data: bytes, client=None) -> None:
        (client or self.redis).set(keys.training_session_answer_key(self.prefix, session_id, key), data,
                                   ex=self.ttl_s)

    def answer(self, session_id: str, key: str) -> bytes | None:
        return self.redis.get(keys.training_session_answer_key(self.prefix, session_id, key))


def job_answer_name(job_id: str) -> str:
    """The answer key's name for a job's own answer (the API reads it once the job ended)."""
    return f"job {job_id}"
