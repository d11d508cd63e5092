"""Training runs in Redis (docs/runs.md): each finished step of a run, per owner, bounded in steps per run,
runs per owner and time after the last step; the previous step's weights for the update ratio; the index
/metrics exports from. The worker records (workers/run_steps.py), the API reads and deletes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone

import msgspec

from gradsvc.wire import MAX_RUN_STEP, RunStep, RunSummary

from . import keys

_step_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(RunStep)

# One script, so a step is recorded whole or not at all, and once: the job's marker (run_job_key) is checked
# and written in it. A step without a number past MAX_RUN_STEP is not recorded (-2: the API refuses it before the
# queue; this holds the bound for two steps racing there), and the run's weights are kept only while every run's
# weights of the owner fit its byte budget (KEYS[4] counts them). It runs inside the worker's success transaction (workers/worker.py), so a step exists
# exactly when its job finished. Keys of evicted runs are built from run_base as keys.run_key builds them.
_RECORD = """
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local base = ARGV[1] .. redis.sha1hex(ARGV[2]) .. ':'
local steps = base .. 'steps'
local ttl = tonumber(ARGV[6])
local step = tonumber(ARGV[3])
if not step then
  local last = redis.call('ZRANGE', steps, -1, -1, 'WITHSCORES')
  if last[2] then step = tonumber(last[2]) + 1 else step = 0 end
  if step > tonumber(ARGV[11]) then return -2 end
end
redis.call('ZREMRANGEBYSCORE', steps, step, step)
redis.call('ZADD', steps, step, ARGV[4])
redis.call('ZREMRANGEBYRANK', steps, 0, -tonumber(ARGV[7]) - 1)
redis.call('EXPIRE', steps, ttl)
local keep = ARGV[9] ~= ''
if keep then
  local others, sizes = 0, redis.call('HGETALL', KEYS[4])
  for i = 1, #sizes, 2 do
    if sizes[i] ~= ARGV[2] then others = others + tonumber(sizes[i + 1]) end
  end
  keep = others + #ARGV[9] <= tonumber(ARGV[12])
end
if keep then
  redis.call('SET', base .. 'weights', ARGV[9], 'EX', ttl)
  redis.call('HSET', KEYS[4], ARGV[2], #ARGV[9])
else
  redis.call('DEL', base .. 'weights')
  redis.call('HDEL', KEYS[4], ARGV[2])
end
redis.call('EXPIRE', KEYS[4], ttl)
local now = tonumber(ARGV[5])
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('EXPIRE', KEYS[1], ttl)
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[8])
if over > 0 then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[1], 0, over - 1)) do
    local b = ARGV[1] .. redis.sha1hex(old) .. ':'
    redis.call('DEL', b .. 'steps', b .. 'weights')
    redis.call('HDEL', KEYS[4], old)
    redis.call('ZREM', KEYS[1], old)
    redis.call('ZREM', KEYS[2], ARGV[10] .. old)
  end
end
redis.call('ZADD', KEYS[2], now, ARGV[10] .. ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
redis.call('HSET', KEYS[3], 'name', ARGV[2], 'step', step)
redis.call('EXPIRE', KEYS[3], ttl)
return step
"""


@dataclass(frozen=True)
class RunBounds:
    """What a run may hold (GRADSVC_RUN_*, gradsvc/runtime/settings.py)."""

    max_steps: int = 10_000
    max_runs: int = 100
    ttl_s: int = 7 * 86400
    weights_max_bytes: int = 64 << 20
    weights_budget_bytes: int = 4 << 30  # every run's weights of one owner: GRADSVC_TENSOR_BUDGET_BYTES

    @classmethod
    def from_settings(cls, settings) -> "RunBounds":
        return cls(settings.run_max_steps, settings.run_max_runs, settings.run_ttl_s, settings.run_weights_max_bytes,
                   settings.tensor_budget_bytes)


@dataclass(frozen=True)
class RunUsage:
    """What the API checks of a run before queueing its step: its last step number (None: no step yet) and the
    bytes the owner's other runs' weights hold."""

    last_step: int | None
    other_weights_bytes: int


@dataclass(frozen=True)
class ExportedRun:
    owner: str
    name: str
    last: RunStep


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat()


def _decoded(raw: bytes, score: float) -> RunStep:
    step = _step_decoder.decode(raw)
    step.step = int(score)  # numbered by the record script: the score is the step
    if step.numcheck is not None and step.numcheck.mode == "off":
        step.numcheck.passed = None  # a step recorded before "off" said null said false: it was never judged
    return step


class RunStore:
    """One owner's runs over a sync Redis client (the API calls it from a thread, the worker directly)."""

    def __init__(self, redis, prefix: str, bounds: RunBounds | None = None) -> None:
        self.redis = redis
        self.prefix = prefix
        self.bounds = bounds or RunBounds()

    # --- the worker's side ---------------------------------------------------------------------------
    def previous_weights(self, owner: str, name: str) -> bytes | None:
        return self.redis.get(keys.run_key(self.prefix, owner, name, "weights"))

    def record(self, client, owner: str, job_id: str, step: RunStep, name: str, numbered: bool,
               weights: bytes = b"") -> None:
        """Adds the step's script call to `client` (the success transaction's pipeline, or Redis itself).
        `numbered`: the request gave step.step; else the script numbers it after the run's last."""
        b, p = self.bounds, self.prefix
        client.eval(_RECORD, 4, keys.runs_key(p, owner), keys.run_exports_key(p), keys.run_job_key(p, job_id),
                    keys.run_weights_sizes_key(p, owner),
                    keys.run_base(p, owner), name, step.step if numbered else "", _step_encoder.encode(step),
                    time.time(), b.ttl_s, b.max_steps, b.max_runs, weights, f"{owner} ", MAX_RUN_STEP,
                    b.weights_budget_bytes)

    # --- the API's check before the queue ----------------------------------------------------------------
    def usage_commands(self, owner: str, name: str) -> list[tuple]:
        """The commands whose replies usage_of reads (sent by the API over its async connection)."""
        return [("ZRANGE", keys.run_key(self.prefix, owner, name, "steps"), -1, -1, "WITHSCORES"),
                ("HGETALL", keys.run_weights_sizes_key(self.prefix, owner))]

    @staticmethod
    def usage_of(replies: list, name: str) -> RunUsage:
        last, sizes = replies
        if isinstance(sizes, list):  # RESP2 without redis-py's reply callbacks: [field, value, ...]
            sizes = dict(zip(sizes[::2], sizes[1::2]))
        other = sum(int(v) for k, v in sizes.items() if (k.decode() if isinstance(k, bytes) else k) != name)
        if last and isinstance(last[0], (list, tuple)):  # redis-py's WITHSCORES callback: [(member, score)]
            last = last[0]
        return RunUsage(int(float(last[1])) if last else None, other)

    def usage(self, owner: str, name: str) -> RunUsage:
        with self.redis.pipeline(transaction=False) as pipe:
            for command in self.usage_commands(owner, name):
                pipe.execute_command(*command)
            return self.usage_of(pipe.execute(), name)

    def weights_bytes(self, owner: str) -> int:
        """Every run's kept weights of the owner, in bytes (what BlobStore.put counts against its budget)."""
        return sum(int(v) for v in self.redis.hvals(keys.run_weights_sizes_key(self.prefix, owner)))

    # --- the API's side ------------------------------------------------------------------------------
    def runs(self, owner: str) -> list[RunSummary]:
        """The owner's runs, most recently stepped first; runs whose steps expired are dropped from the index."""
        index = keys.runs_key(self.prefix, owner)
        names = [(n.decode(), ts) for n, ts in self.redis.zrevrange(index, 0, -1, withscores=True)]
        with self.redis.pipeline(transaction=False) as pipe:
            for name, _ in names:
                pipe.zrange(keys.run_key(self.prefix, owner, name, "steps"), -1, -1, withscores=True)
                pipe.zcard(keys.run_key(self.prefix, owner, name, "steps"))
            replies = pipe.execute()
        out, gone = [], []
        for (name, ts), last, count in zip(names, replies[::2], replies[1::2]):
            if not count:
                gone.append(name)
                continue
            out.append(RunSummary(name=name, steps=count, last_step=int(last[0][1]), updated_at=_iso(ts)))
        if gone:
            self.redis.zrem(index, *gone)
        return out

    def steps(self, owner: str, name: str) -> list[RunStep] | None:
        """The run's steps in order, or None when the owner has no such run."""
        raw = self.redis.zrange(keys.run_key(self.prefix, owner, name, "steps"), 0, -1, withscores=True)
        return [_decoded(r, s) for r, s in raw] if raw else None

    def delete(self, owner: str, name: str) -> bool:
        p = self.prefix
        with self.redis.pipeline() as pipe:
            pipe.delete(keys.run_key(p, owner, name, "steps"), keys.run_key(p, owner, name, "weights"))
            pipe.hdel(keys.run_weights_sizes_key(p, owner), name)
            pipe.zrem(keys.runs_key(p, owner), name)
            pipe.zrem(keys.run_exports_key(p), f"{owner} {name}")
            deleted, *_ = pipe.execute()
        return deleted > 0

    def job_run(self, job_id: str) -> tuple[str, int] | None:
        """The run and step a job was recorded as (the job page's link), or None."""
        name, step = self.redis.hmget(keys.run_job_key(self.prefix, job_id), "name", "step")
        return None if name is None else (name.decode(), int(step))

    def exported(self, limit: int, idle_s: float, owner: str | None = None) -> list[ExportedRun]:
        """The `limit` most recently stepped runs of every owner (or of `owner` alone) stepped within `idle_s`,
        with their last steps."""
        if limit <= 0:
            return []
        window = {} if owner is not None else {"start": 0, "num": limit}  # an owner's: filtered, then cut
        members = self.redis.zrevrangebyscore(keys.run_exports_key(self.prefix), "+inf", time.time() - idle_s,
                                              **window)
        runs = [m.decode().split(" ", 1) for m in members]
        if owner is not None:
            runs = [r for r in runs if r[0] == owner][:limit]
        with self.redis.pipeline(transaction=False) as pipe:
            for owner, name in runs:
                pipe.zrange(keys.run_key(self.prefix, owner, name, "steps"), -1, -1, withscores=True)
            replies = pipe.execute()
        return [ExportedRun(owner, name, _decoded(*last[0])) for (owner, name), last in zip(runs, replies) if last]
