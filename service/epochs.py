"""Redis's data epoch: job ids carry the epoch they were issued in, so a job whose record Redis lost
(restarted without its data) reads as lost, not as one that never existed."""

from __future__ import annotations

import secrets
import time
import uuid

from redis import Redis

from gradsvc.broker import keys

EPOCH_HEX = 8  # a job id's first 8 hex digits: its epoch (the other 90 random bits keep it unguessable)


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
        """The current epoch; a new one when Redis holds none (it restarted empty). One GET, a SET NX and a
        SADD of the epoch this process knew before when that happens."""
        raw = self.redis.get(self.key)
        if raw is None:
            self.redis.set(self.key, f"{secrets.token_hex(EPOCH_HEX // 2)} {time.time():.3f}", nx=True)
            raw = self.redis.get(self.key)
        epoch, began = raw.decode().split(" ", 1)
        if self.current is not None and epoch != self.current:
            self.past.add(self.current)
            self.redis.sadd(self.past_key, *self.past)
        self.current, self.began = epoch, float(began)
        return epoch

    def new_job_id(self) -> str:
        """A UUID whose first 8 hex digits are the current epoch."""
        epoch = self.current or self.refresh()
        return str(uuid.UUID(hex=epoch + uuid.uuid4().hex[EPOCH_HEX:]))

    def is_lost(self, job_id: str) -> bool:
        """Whether `job_id`, absent from Redis, was issued in an earlier epoch: Redis lost it."""
        epoch = job_id[:EPOCH_HEX]
        if epoch == self.refresh():
            return False
        return epoch in self.past or bool(self.redis.sismember(self.past_key, epoch))

    def began_within(self, age_s: float) -> bool:
        """Whether the current epoch began within the last `age_s` seconds (after a request first sent then)."""
        self.refresh()
        return time.time() - self.began < age_s + 1.0  # 1 s: clocks of several API hosts
