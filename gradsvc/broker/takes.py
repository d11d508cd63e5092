"""Taking several jobs at once: a worker that dequeued a job (RQ's BLPOP) takes up to GRADSVC_WORKER_TAKE - 1 more
queued behind it, in one Lua script, and runs them one after another without asking Redis for each.

    take        LPOP up to n ids from the queue the first job came from, RPUSHed onto the worker's taken list
                (keys.taken_key) and the worker named in the takers set, all in one script: each id is in exactly
                one of the two lists at any time. At most the worker's share of what is queued (the queue's length
                over the workers listening on it), so one worker does not hold a burst while another is idle
    start       a taken job leaves the taken list (LREM) in the MULTI/EXEC that marks it started and puts it in
                RQ's started registry (workers/worker.py prepare_job_execution): it is in exactly one of them
    give back   the ids still in a taken list are pushed back to the front of their queues (the job hash's
                `origin`), in their order, and the list deleted: by the worker itself when it stops or when its
                own lease may have lapsed, and by every worker's heartbeat for the workers whose RQ key is gone
                (killed, or cut off from Redis longer than their lease)

A taken job is still `queued` for RQ and the API (its status and every registry are as while it waited in the
queue); a worker killed with k jobs taken loses none: its running job is reaped (worker_lost) as before, the others
are queued again within a lease and run once. A worker starts a taken job only while its own lease (renewed by its
heartbeat thread) has at least one heartbeat left, so its key still exists when the start transaction arrives and no
other worker can have given that job back meanwhile. Only shared queues are taken from, never a worker's own queue:
pinned and affinity-routed jobs keep affinity.py's rules. Keys of jobs, queues and workers are built in the scripts
from RQ's prefixes (a single Redis, as RQ's own scripts and affinity.py assume).
"""

from __future__ import annotations

from . import keys

# KEYS: the queue's list, the taken list, the takers set, RQ's set of the queue's workers. ARGV: the most ids to take,
# the worker's name. Takes at most its share of what is queued (the length over the workers listening, this one
# counted), so that a burst is not held by one worker while another is idle.
_TAKE = """
local share = math.floor(redis.call('LLEN', KEYS[1]) / math.max(1, redis.call('SCARD', KEYS[4])))
local ids = {}
for _ = 1, math.min(tonumber(ARGV[1]), share) do
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  redis.call('RPUSH', KEYS[2], id)
  ids[#ids + 1] = id
end
if #ids > 0 then redis.call('SADD', KEYS[3], ARGV[2]) end
return ids
"""

# Pushes a taken list back (used by both scripts below): `jobs` is RQ's job key prefix, `queues` its queue key prefix,
# `known` RQ's set of queues. Only a job still queued goes back: one deleted or canceled meanwhile (the API's cancel
# removes a queued job from its queue, which a taken one is not in) is dropped.
_GIVE_BACK_LIST = """
local function give_back(taken, jobs, queues, known)
  local ids = redis.call('LRANGE', taken, 0, -1)
  for i = #ids, 1, -1 do
    local origin, status = unpack(redis.call('HMGET', jobs .. ids[i], 'origin', 'status'))
    if origin and status == 'queued' then
      redis.call('LPUSH', queues .. origin, ids[i])
      redis.call('SADD', known, queues .. origin)
    end
  end
  redis.call('DEL', taken)
  return #ids
end
"""

# KEYS: the taken list, RQ's set of queues, the takers set. ARGV: job prefix, queue prefix, the worker's name.
_GIVE_BACK = _GIVE_BACK_LIST + """
local n = give_back(KEYS[1], ARGV[1], ARGV[2], KEYS[2])
redis.call('SREM', KEYS[3], ARGV[3])
return n
"""

# KEYS: the takers set, RQ's set of queues. ARGV: job prefix, queue prefix, RQ's worker key prefix, the taken lists'
# prefix. Gives back the taken jobs of every worker whose RQ key is gone; returns how many.
_REAP = "redis.replicate_commands()\n" + _GIVE_BACK_LIST + """
local n = 0
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[3] .. name) == 0 then
    n = n + give_back(ARGV[4] .. name, ARGV[1], ARGV[2], KEYS[2])
    redis.call('SREM', KEYS[1], name)
  end
end
return n
"""


def _rq_prefixes() -> tuple[str, str, str, str]:
    from rq import Queue
    from rq.job import Job
    from rq.worker import Worker

    return Job.redis_job_namespace_prefix, Queue.redis_queue_namespace_prefix, Worker.redis_worker_namespace_prefix, \
        Queue.redis_queues_keys


class Takes:
    """One worker's takes (`redis`: its client; `prefix`: the queue prefix; `name`: the worker's name)."""

    def __init__(self, redis, prefix: str, name: str) -> None:
        self.prefix, self.name = prefix, name
        self.key = keys.taken_key(prefix, name)
        self._take = redis.register_script(_TAKE)
        self._give_back = redis.register_script(_GIVE_BACK)
        self._reap = redis.register_script(_REAP)

    def take(self, queue: str, n: int) -> list[str]:
        """Up to `n` ids from the front of `queue` (a queue name), at most its share of them (their number over the
        workers that listen on it), now on this worker's taken list."""
        if n <= 0:
            return []
        ids = self._take(keys=[keys.rq_queue_key(queue), self.key, keys.takers_key(self.prefix),
                               keys.rq_queue_workers_key(queue)], args=[n, self.name])
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    def give_back(self) -> int:
        """This worker's taken jobs not started, back at the front of their queues; how many."""
        jobs, queues, _, known = _rq_prefixes()
        return int(self._give_back(keys=[self.key, known, keys.takers_key(self.prefix)],
                                   args=[jobs, queues, self.name]))

    def reap(self) -> int:
        """Every gone worker's taken jobs, back at the front of their queues; how many."""
        jobs, queues, workers, known = _rq_prefixes()
        return int(self._reap(keys=[keys.takers_key(self.prefix), known],
                              args=[jobs, queues, workers, keys.taken_key(self.prefix, "")]))
