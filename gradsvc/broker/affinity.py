"""Affinity: a job whose model a worker holds (gradsvc/engine/resident.py) goes to that worker's own queue first.

    the worker     after a job whose model it kept resident: record_holder(owner, model key -> its name, TTL); after
                   a training session's create, the session's frozen base (base_key) while it has room for more
    the API        route(): the holder's own queue when the holder is alive (its RQ key, the lease its heartbeat
                   renews, without the `death` field RQ writes when a worker stops: RQ keeps a stopped worker's
                   key 60 s), else the queue the job would have gone to (its fallback); a job put in an own queue
                   is tracked with its fallback and the time it may wait there until (GRADSVC_AFFINITY_WAIT_MS),
                   in the enqueue's transaction
    every worker   its heartbeat thread runs move_overdue(): a job still in an own queue past its wait (its worker
                   busy or gone), or a pinned job whose worker is gone, is moved to the front of its fallback queue;
                   and at each heartbeat sweep_gone(): a gone worker's own queue is emptied the same way at once,
                   and its name removed from RQ's set of queues

A move is one Lua script: LREM from the own queue, and only when that removed it, the job's `origin` set to the
fallback and its id pushed there. A worker's dequeue (BLPOP/LMOVE) and a move are both atomic in Redis, so a job
is taken by exactly one of them: never run twice, never lost. A queued job is in no RQ registry (only its queue's
list), so nothing else changes. Pinned jobs (`pinned`, for steps of a session that lives on that worker) are
never moved while their worker is alive. Times are Redis's own (TIME in the scripts): workers and the API may run
on machines whose clocks differ. No torch here; the store is handed a client.
"""

from __future__ import annotations

import hashlib

import msgspec

from gradsvc import hashing
from gradsvc.wire import GradientRequest

from . import keys

_json = msgspec.json.Encoder(order="sorted")
HOLDER_TTL_S = 3600  # how long a holder record lasts unless a job renews it

# KEYS: the holder record. ARGV: RQ's worker key prefix. The holder's name when its worker is alive (worker_alive),
# else nil.
_ROUTE = """
local name = redis.call('GET', KEYS[1])
if name and redis.call('EXISTS', ARGV[1] .. name) == 1 and redis.call('HEXISTS', ARGV[1] .. name, 'death') == 0 then
  return name
end
return false
"""

# KEYS: the waiting set, the pinned set, the fallback hash. ARGV: the job id, its fallback queue, the seconds it may
# wait (ignored when pinned), "1" when pinned.
_TRACK = """
redis.replicate_commands()
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
if ARGV[4] == '1' then
  redis.call('SADD', KEYS[2], ARGV[1])
else
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[1], t[1] + t[2] / 1e6 + tonumber(ARGV[3]), ARGV[1])
end
return 1
"""

# KEYS: the waiting set, the pinned set, the fallback hash, RQ's set of queues. ARGV: RQ's job key prefix, queue
# key prefix and worker key prefix, the own queues' prefix, the most jobs to look at, the taken lists' prefix.
# Returns the ids moved.
# Keys of jobs, queues and workers are built here from the prefixes (a single Redis, as RQ's own scripts assume).
_MOVE = """
redis.replicate_commands()
local jobs, queues, workers, own, limit, taken = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6]
local t = redis.call('TIME')
local now = t[1] + t[2] / 1e6
local candidates = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, limit)
for _, id in ipairs(redis.call('SRANDMEMBER', KEYS[2], limit)) do
  local origin = redis.call('HGET', jobs .. id, 'origin')
  if not origin or string.sub(origin, 1, #own) ~= own then
    candidates[#candidates + 1] = id
  elseif redis.call('EXISTS', workers .. string.sub(origin, #own + 1)) == 0 or
      redis.call('HEXISTS', workers .. string.sub(origin, #own + 1), 'death') == 1 then
    candidates[#candidates + 1] = id
  elseif not redis.call('LPOS', queues .. origin, id) then
    candidates[#candidates + 1] = id
  end
end
local moved = {}
for _, id in ipairs(candidates) do
  local fallback = redis.call('HGET', KEYS[3], id)
  local origin = redis.call('HGET', jobs .. id, 'origin')
  local mine = fallback and origin and string.sub(origin, 1, #own) == own
  local again = mine and redis.call('LREM', queues .. origin, 1, id) == 1
  local taking = false
  if mine and not again and redis.call('HGET', jobs .. id, 'status') == 'queued' then
    -- Not in its queue and not started: its worker took it (RQ's BLPOP). A live worker is starting it (it stays
    -- tracked until it has); one killed before starting it never will: it is queued again. A job on the worker's
    -- taken list (takes.py) is the takes reaper's to give back, into its queue: it stays tracked too.
    local name = string.sub(origin, #own + 1)
    local holder = workers .. name
    if redis.call('LPOS', taken .. name, id) then
      taking = true
    elseif redis.call('EXISTS', holder) == 0 or redis.call('HEXISTS', holder, 'death') == 1 then
      again = true
    else
      taking = true
    end
  end
  if not taking then
    redis.call('ZREM', KEYS[1], id)
    redis.call('SREM', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
  end
  if again then
    redis.call('HSET', jobs .. id, 'origin', fallback)
    redis.call('LPUSH', queues .. fallback, id)
    redis.call('SADD', KEYS[4], queues .. fallback)
    moved[#moved + 1] = id
  end
end
return moved
"""

# KEYS: the waiting set, the pinned set, the fallback hash, RQ's set of queues. ARGV: RQ's job key prefix, queue key
# prefix and worker key prefix, the own queues' prefix, the queue a job goes to when it has no fallback recorded.
# Every own queue in RQ's set whose worker is gone (no key, or its `death` written): its jobs, in their order, to the
# front of their fallback queues (a job whose record expired is dropped), the list deleted and its name removed from
# the set. Returns how many jobs moved.
_SWEEP = """
redis.replicate_commands()
local jobs, queues, workers, own, default = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local head = queues .. own
local moved = 0
-- A job to the front of its fallback queue, its tracking dropped (one whose record expired is dropped alone).
local function requeue(id)
  local fallback = redis.call('HGET', KEYS[3], id) or default
  redis.call('ZREM', KEYS[1], id)
  redis.call('SREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  if redis.call('EXISTS', jobs .. id) == 1 then
    redis.call('HSET', jobs .. id, 'origin', fallback)
    redis.call('LPUSH', queues .. fallback, id)
    redis.call('SADD', KEYS[4], queues .. fallback)
    moved = moved + 1
  end
end
for _, qkey in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  if string.sub(qkey, 1, #head) == head then
    local worker = workers .. string.sub(qkey, #head + 1)
    if redis.call('EXISTS', worker) == 0 or redis.call('HEXISTS', worker, 'death') == 1 then
      local ids = redis.call('LRANGE', qkey, 0, -1)
      for i = #ids, 1, -1 do
        requeue(ids[i])
      end
      redis.call('DEL', qkey)
      redis.call('SREM', KEYS[4], qkey)
      -- What it had taken (RQ's BLMOVE into the queue's intermediate list) and never started: queued again.
      -- A started one is its lease's to fail (worker_lost); RQ's own cleanup of this list ran only on its worker.
      local taken = qkey .. ':intermediate'
      for _, id in ipairs(redis.call('LRANGE', taken, 0, -1)) do
        if redis.call('HGET', jobs .. id, 'status') == 'queued' then
          requeue(id)
        end
      end
      redis.call('DEL', taken)
    end
  end
end
return moved
"""

MOVE_BATCH = 256  # the most jobs one move_overdue call looks at (each call holds Redis a few us a job)


def model_key(request: GradientRequest, graph_ref: str | None = None) -> str:
    """What a worker's resident model is known by across processes: the model's structure and dtype (a layer spec's
    canonical JSON, or its graph's ref), not its weights (a changed weight is copied into the held model)."""
    model = request.model
    if model.layers is not None:
        digest = hashlib.sha256(_json.encode(model.layers)).hexdigest()
        return f"layers:{model.dtype}:{digest}"
    ref = graph_ref or model.graph_ref or hashing.digest(hashing.encode(model.graph))
    return f"graph:{model.dtype}:{ref}"


# The holder records of frozen bases (base_key) are not an owner's: a key routed to a worker holding a base shares
# it there only for the pieces the API found the key holds (gradsvc/engine/frozen.py).
BASES = "*bases"


def base_key(dtype: str, frozen: dict) -> str | None:
    """What a training session's frozen base sent by reference (wire.by_reference: name -> Tensor with refs) is
    known by across workers: its pieces, shapes and dtype, not its names; None without one."""
    if not frozen:
        return None
    parts = sorted(f"{t.dtype}:{list(t.shape)}:{','.join(t.refs)}" for t in frozen.values())
    return f"base:{dtype}:{hashlib.sha256(_json.encode(parts)).hexdigest()}"


def worker_alive(redis, worker_name: str) -> bool:
    """Whether the worker's RQ key is there without a `death` field: its heartbeat renews it for a lease (3
    heartbeats); a worker killed or cut off from Redis loses it within that, and a stopped one wrote its death
    (RQ's register_death, which keeps the key 60 s more). One round trip."""
    return bool(workers_alive(redis, [worker_name]))


def workers_alive(redis, names: list[str]) -> set[str]:
    """Those of `names` whose worker is alive (worker_alive), in one round trip."""
    with redis.pipeline(transaction=False) as pipe:
        for name in names:
            key = keys.rq_worker_key(name)
            pipe.exists(key).hexists(key, "death")
        answers = pipe.execute()
    return {n for n, exists, dead in zip(names, answers[::2], answers[1::2]) if exists and not dead}


def record_holder(redis, prefix: str, owner: str, model_key: str, worker_name: str, ttl_s: int) -> None:
    """The worker `worker_name` holds the owner's model `model_key` (for ttl_s: a record outlived by an eviction
    costs a job a build, never a wrong answer)."""
    redis.set(keys.holder_key(prefix, owner, model_key), worker_name, ex=ttl_s)


def drop_holder(redis, prefix: str, owner: str, model_key: str, worker_name: str) -> None:
    """Removes the record of `model_key` when it names `worker_name` (a worker full of sessions: no more to it)."""
    key = keys.holder_key(prefix, owner, model_key)
    name = redis.get(key)
    if name is not None and (name.decode() if isinstance(name, bytes) else name) == worker_name:
        redis.delete(key)


def holder(redis, prefix: str, owner: str, model_key: str) -> str | None:
    """The worker that last recorded the owner's model, or None."""
    name = redis.get(keys.holder_key(prefix, owner, model_key))
    return name.decode() if isinstance(name, bytes) else name


def route(redis, prefix: str, owner: str, model_key: str | None, fallback: str) -> str:
    """The queue a job goes to: the own queue of the worker holding the owner's model when that worker is alive,
    else `fallback` (the queue the job would go to without affinity). One round trip."""
    if model_key is None:
        return fallback
    from rq.worker import Worker

    name = redis.register_script(_ROUTE)(keys=[keys.holder_key(prefix, owner, model_key)],
                                         args=[Worker.redis_worker_namespace_prefix])
    if not name:
        return fallback
    return keys.own_queue_name(prefix, name.decode() if isinstance(name, bytes) else name)


class Mover:
    """The scripts that track a job put in an own queue and move it out when it may wait no longer, registered
    once on a client."""

    def __init__(self, redis, prefix: str) -> None:
        self.redis, self.prefix = redis, prefix
        self._track = redis.register_script(_TRACK)
        self._move = redis.register_script(_MOVE)
        self._sweep = redis.register_script(_SWEEP)

    def track(self, pipe, job_id: str, fallback: str, wait_s: float, pinned: bool = False) -> None:
        """Adds to `pipe` (the enqueue's transaction) the record of a job put in an own queue: the queue it moves
        to, and until when it may wait (or, `pinned`, that it waits as long as its worker lives)."""
        p = self.prefix
        self._track(keys=[keys.affinity_waiting_key(p), keys.affinity_pinned_key(p), keys.affinity_fallback_key(p)],
                    args=[job_id, fallback, repr(float(wait_s)), "1" if pinned else "0"], client=pipe)

    def move_overdue(self) -> list[str]:
        """Moves every job that waited past its time in an own queue, and every pinned job whose worker is gone,
        to the front of its fallback queue; the ids moved."""
        from rq import Queue
        from rq.job import Job
        from rq.worker import Worker

        p = self.prefix
        moved = self._move(keys=[keys.affinity_waiting_key(p), keys.affinity_pinned_key(p),
                                 keys.affinity_fallback_key(p), Queue.redis_queues_keys],
                           args=[Job.redis_job_namespace_prefix, Queue.redis_queue_namespace_prefix,
                                 Worker.redis_worker_namespace_prefix, keys.own_queue_name(p, ""), MOVE_BATCH,
                                 keys.taken_key(p, "")])
        return [m.decode() if isinstance(m, bytes) else m for m in moved]

    def sweep_gone(self, default: str) -> int:
        """Empties the own queue of every worker that is gone (killed: its key lapsed with its lease; stopped: its
        `death` written), whatever its jobs' waits: each job to the front of its fallback queue (`default`, the
        shared queue, for one with none recorded), and the queue's name out of RQ's set of queues (which lists it
        in Queue.all() and the API's queue depths); how many jobs moved."""
        from rq import Queue
        from rq.job import Job
        from rq.worker import Worker

        p = self.prefix
        return int(self._sweep(keys=[keys.affinity_waiting_key(p), keys.affinity_pinned_key(p),
                                     keys.affinity_fallback_key(p), Queue.redis_queues_keys],
                               args=[Job.redis_job_namespace_prefix, Queue.redis_queue_namespace_prefix,
                                     Worker.redis_worker_namespace_prefix, keys.own_queue_name(p, ""), default]))
