"""Training sessions in Redis (docs/sessions.md), shared by the API and the workers: each session's record (its
owner, the worker that holds it, where it stands), its last checkpoint (safetensors bytes), the answers of its
steps (by job, and by idempotency key for a retry) and each owner's set of sessions. Everything of a session
expires GRADSVC_SESSION_IDLE_TTL_S after its last use; every write refreshes it.

A session's state changes through one serialised path: after its creation (admit), only a worker's commit
writes its record, and a commit is conditional on the record the worker read (a compare-and-set of the
record's bytes, in one Lua script with the checkpoint, the owner's index and the answer kept for the step's
idempotency key). A DELETE removes the record, so a commit after it finds none and writes nothing (a deleted
session stays deleted); of two workers that restored the same session and stepped it at once, the second to
commit finds the record changed and its step is not applied (the API sends it again). A new session's record is
written by one Lua script that counts the owner's live sessions and their bytes and writes it only within the
limits (admit), so two concurrent POST /sessions at the limit cannot both get in."""

from __future__ import annotations

import time

import msgspec

from gradsvc.wire import SessionCreate, SessionInfo, SessionStepResult, refs_only

from . import keys

# The session job function, by the dotted path RQ records (the API imports nothing of workers/).
SESSION_JOB = "workers.session_jobs.session_job"
OPS = ("create", "step", "forward_backward", "forward", "optim_step", "weights", "delete")
# A job's own answer waits this long for the API, which reads it once and deletes it (a weights download is not
# kept in Redis past its read); a call that waited out its HTTP wait is answered again through its idempotency key.
JOB_ANSWER_TTL_S = 300


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
    # A session over several workers (options.workers): its members, rank 0 (the holder) first, and the number of
    # their process group: a new set of members (one was lost) is the next generation, rebuilt from the checkpoint.
    members: list[str] = []
    generation: int = 0

    def info(self, session_id: str) -> SessionInfo:
        return SessionInfo(session_id=session_id, step=self.step, accumulated=self.accumulated,
                           optimizer=self.create.optimizer, parameter_count=self.parameter_count,
                           state_bytes=self.state_bytes, device=self.device, worker=self.holder,
                           checkpoint_step=self.checkpoint_step, checkpoint_every=self.checkpoint_every,
                           run=self.create.run, created_at=self.created_at, last_used_at=self.last_used_at,
                           last=self.last, members=list(self.members))


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

# KEYS: the record, the checkpoint, the owner's index, the answers by idempotency key. ARGV: the record as the
# worker read it, the new record, the TTL, the session id, its state bytes, "1" when a checkpoint follows, the
# checkpoint, the answer's field ("" for none), the answer, then the fields of the keys the session forgot.
# Answers 1 (written), 0 (no record: deleted or expired) or -1 (the record changed since it was read).
_COMMIT = """
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
if current ~= ARGV[1] then return -1 end
local ttl = ARGV[3]
redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
if ARGV[6] == '1' then redis.call('SET', KEYS[2], ARGV[7], 'EX', ttl) else redis.call('EXPIRE', KEYS[2], ttl) end
redis.call('HSET', KEYS[3], ARGV[4], ARGV[5])
redis.call('EXPIRE', KEYS[3], ttl)
if ARGV[8] ~= '' then redis.call('HSET', KEYS[4], ARGV[8], ARGV[9]) end
for i = 10, #ARGV do redis.call('HDEL', KEYS[4], ARGV[i]) end
redis.call('EXPIRE', KEYS[4], ttl)
return 1
"""
COMMITTED, GONE, CHANGED = 1, 0, -1


def new_record(owner: str, create: SessionCreate) -> SessionRecord:
    """The record of a new session: its body without its weights (in its checkpoint), but for the frozen ones
    sent by reference, kept by their refs (frozen.py: no checkpoint holds them)."""
    now = time.time()
    base = refs_only(create.model.weights, set(create.options.freeze)) or None
    return SessionRecord(owner=owner, create=msgspec.structs.replace(
        create, model=msgspec.structs.replace(create.model, weights=base)), created_at=now, last_used_at=now)


class SessionRecords:
    """The sessions' keys over a sync Redis client (the API calls it from a thread, the worker directly)."""

    def __init__(self, redis, prefix: str, ttl_s: int, worker: str = "") -> None:
        self.redis, self.prefix, self.ttl_s = redis, prefix, ttl_s
        self.worker = worker  # on a worker: its name, which a record's holder is compared with
        self._admit = redis.register_script(_ADMIT)
        self._commit = redis.register_script(_COMMIT)

    def get(self, session_id: str) -> SessionRecord | None:
        return self.read(session_id)[0]

    def read(self, session_id: str) -> tuple[SessionRecord | None, bytes | None]:
        """(the record, its bytes as read: what a commit compares the record with)."""
        raw = self.redis.get(keys.training_session_key(self.prefix, session_id))
        return (_decoder.decode(raw), raw) if raw else (None, None)

    def many(self, session_ids: list[str]) -> list[SessionRecord | None]:
        """The records of these sessions, in order (None where there is none), in one round trip."""
        raws = self.redis.mget([keys.training_session_key(self.prefix, i) for i in session_ids])
        return [_decoder.decode(raw) if raw else None for raw in raws]

    def commit(self, session_id: str, read: bytes, rec: SessionRecord, state: bytes | None = None,
               answer: tuple[str, bytes] | None = None, forgotten: tuple[str, ...] = ()) -> int:
        """Writes `rec` (a checkpoint with it when given, the answer kept under an idempotency key, the keys the
        session forgot dropped) only when the record still holds the bytes `read`, all in one step. Answers
        COMMITTED, GONE (the session was deleted or expired: nothing written) or CHANGED (another worker
        committed since `read`: nothing written)."""
        p = self.prefix
        field, data = answer if answer is not None else ("", b"")
        return int(self._commit(
            keys=[keys.training_session_key(p, session_id), keys.training_session_state_key(p, session_id),
                  keys.training_sessions_key(p, rec.owner), keys.training_session_answers_key(p, session_id)],
            args=[read, _encoder.encode(rec), self.ttl_s, session_id, rec.state_bytes, "1" if state is not None
                  else "0", state or b"", field and keys.answer_field(field), data,
                  *(keys.answer_field(k) for k in forgotten)]))

    def owned(self, owner: str, session_id: str) -> SessionRecord | None:
        """The record when `owner` owns the session; another key's session reads as none."""
        rec = self.get(session_id)
        return rec if rec is not None and rec.owner == owner else None

    def put(self, session_id: str, rec: SessionRecord, state: bytes | None = None) -> None:
        """Writes the record (and a checkpoint when given) unconditionally: for tests and tools that set a
        session up; the service's own writes are admit() and commit()."""
        p, ttl = self.prefix, self.ttl_s
        with self.redis.pipeline() as pipe:
            pipe.set(keys.training_session_key(p, session_id), _encoder.encode(rec), ex=ttl)
            if state is not None:
                pipe.set(keys.training_session_state_key(p, session_id), state, ex=ttl)
            pipe.hset(keys.training_sessions_key(p, rec.owner), session_id, rec.state_bytes)
            pipe.expire(keys.training_sessions_key(p, rec.owner), ttl)
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
        pipe.delete(keys.training_session_key(p, session_id), keys.training_session_state_key(p, session_id),
                    keys.training_session_answers_key(p, session_id))
        pipe.hdel(keys.training_sessions_key(p, owner), session_id)
        pipe.execute()

    def answer(self, session_id: str, key: str) -> bytes | None:
        """The answer kept for the step applied under idempotency key `key`."""
        return self.redis.hget(keys.training_session_answers_key(self.prefix, session_id), keys.answer_field(key))


def job_answer_name(job_id: str) -> str:
    """The answer key's name for a job's own answer (the API reads it once the job ended)."""
    return f"job {job_id}"
