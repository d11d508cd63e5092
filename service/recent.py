"""The per-owner index of recent jobs: written with each enqueue, read by the job list page."""

from __future__ import annotations

import time

from gradsvc.broker import keys

# The index keeps an owner's newest jobs only: a page lists them, and a key that submits thousands of
# jobs must not grow a Redis entry without bound.
RECENT_JOBS = 50


def record(pipe, prefix: str, owner: str, job_id: str, ttl_s: int) -> None:
    """Adds the job to the owner's index in `pipe` (the enqueue's own transaction); the index expires with
    the last result it can name."""
    for command in commands(prefix, owner, job_id, ttl_s):
        pipe.execute_command(*command)


def commands(prefix: str, owner: str, job_id: str, ttl_s: int) -> list[tuple]:
    """record()'s commands, for a transaction sent as a list (service/enqueue.py's on the event loop)."""
    key = keys.owner_jobs_key(prefix, owner)
    return [("ZADD", key, time.time(), job_id), ("ZREMRANGEBYRANK", key, 0, -RECENT_JOBS - 1), ("EXPIRE", key, ttl_s)]


async def recent(aredis, prefix: str, owner: str, limit: int = RECENT_JOBS) -> list[str]:
    """The owner's job ids, newest first (some may have expired since)."""
    ids = await aredis.zrevrange(keys.owner_jobs_key(prefix, owner), 0, limit - 1)
    return [i.decode() for i in ids]
