"""Redis's data epoch: job ids carry the epoch they were issued in, so a job whose record Redis lost
(restarted without its data) reads as lost, not as one that never existed.

The epoch's record also names the Redis process (its run_id) it began on. Another process serving the
data (Redis restarted from its append-only file, or a replica promoted by Sentinel) may lack the last
writes acknowledged before it: with appendfsync everysec up to a second of them, after a failover what
had not reached the replica. A new epoch then begins, so a job whose record went with them reads as
lost and an Idempotency-Key retry whose key went with them is refused, not run again; unless that
process provably lost nothing (its AOF fsynced on every write, and it was not promoted from a replica).
"""

from __future__ import annotations

import secrets
import time
import uuid

from redis import Redis
from redis.exceptions import ResponseError

from gradsvc.broker import keys

# A job id's last 8 hex digits: its epoch (the other 90 random bits keep it unguessable). Last, so that ids
# of one Redis lifetime differ from their first characters, which people read and lists abbreviate.
EPOCH_HEX = 8
# The epoch record swapped only if no other API process swapped it first; an epoch ended goes to the past set.
_SWAP = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  if ARGV[3] ~= '' then redis.call('SADD', KEYS[2], ARGV[3]) end
  return ARGV[2]
end
return current
"""


def _new_epoch() -> str:
    """A new epoch's record, less its run id: the epoch and the unix time it began."""
    return f"{secrets.token_hex(EPOCH_HEX // 2)} {time.time():.3f}"


class Epochs:
    """The current epoch, read from Redis (and started there when missing), and the past ones seen."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self.key = keys.epoch_key(prefix)
        self.past_key = keys.past_epochs_key(prefix)
        self.current: str | None = None
        self.began: float = 0.0  # unix time the current epoch began
        self.past: set[str] = set()

    def refresh(self) -> str:
        """The current epoch; a new one when Redis holds none (it restarted empty) or when another Redis
        process than the epoch's serves the data and may have lost writes (see the module's docstring).
        One GET and an INFO; a SET NX, or a swap, and a SADD of the epoch this process knew before when
        the epoch changes."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.key)
            pipe.info("server")
            raw, server = pipe.execute()
        run_id = str(server.get("run_id", ""))
        if raw is None:
            self.redis.set(self.key, f"{_new_epoch()} {run_id}", nx=True)
            raw = self.redis.get(self.key)
        epoch, began, *on = raw.decode().split(" ")
        if on != [run_id]:
            # Another process serves the data: the same epoch goes on when nothing can be missing (or the
            # record predates run ids), else a new one begins.
            kept = not on or self._kept_every_write()
            swapped = f"{epoch} {began} {run_id}" if kept else f"{_new_epoch()} {run_id}"
            raw = self.redis.eval(_SWAP, 2, self.key, self.past_key, raw, swapped, "" if kept else epoch)
            epoch, began, *_ = raw.decode().split(" ")
        if self.current is not None and epoch != self.current:
            self.past.add(self.current)
            self.redis.sadd(self.past_key, *self.past)
        self.current, self.began = epoch, float(began)
        return epoch

    def _kept_every_write(self) -> bool:
        """Whether this Redis process holds every write acknowledged before it started serving: it loaded an
        AOF fsynced on every write (appendfsync always) and was not promoted from a replica."""
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.info("persistence")
                pipe.info("replication")
                pipe.config_get("appendfsync")
                persistence, replication, fsync = pipe.execute()
        except ResponseError:  # CONFIG disabled (a managed Redis): assume the worst
            return False
        return (persistence.get("aof_enabled") == 1 and fsync.get("appendfsync") == "always"
                and replication.get("second_repl_offset") == -1)

    def new_job_id(self) -> str:
        """A random UUID (version 4) whose last 8 hex digits are the current epoch."""
        epoch = self.current or self.refresh()
        return str(uuid.UUID(hex=uuid.uuid4().hex[:-EPOCH_HEX] + epoch))

    def is_lost(self, job_id: str) -> bool:
        """Whether `job_id`, absent from Redis, was issued in an earlier epoch: Redis lost it. Ids issued
        before the epoch moved to their end carry it first; both places are read (a random match is 2^-32)."""
        digits = job_id.replace("-", "")
        epochs = {digits[-EPOCH_HEX:], digits[:EPOCH_HEX]}
        if self.refresh() in epochs:
            return False
        if epochs & self.past:
            return True
        with self.redis.pipeline(transaction=False) as pipe:
            for epoch in epochs:
                pipe.sismember(self.past_key, epoch)
            return any(pipe.execute())

    def began_within(self, age_s: float) -> bool:
        """Whether the current epoch began within the last `age_s` seconds (after a request first sent then)."""
        self.refresh()
        return time.time() - self.began < age_s + 1.0  # 1 s: clocks of several API hosts
