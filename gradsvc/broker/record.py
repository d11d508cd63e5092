"""What gradsvc keeps in an RQ job's `meta`, typed: each field has one writer, and every read and write
goes through JobMeta and the functions below, never `job.meta[...]`.

    field     written by                                              read by
    owner     the API's enqueue (the key's id)                        the API (ownership), the worker
    shards    the API's sharded enqueue (the shard job ids)           the API (progress, cancel)
    shard     the API's sharded enqueue (a shard's place)             the worker, the fan-in
    progress  the worker's progress reporter                          the API
    error     whoever ends the job failed: the worker, its watchdog,  the API, the fan-in
              the fan-in (a failed shard's parent), the API's cancel
              of a job that had not started
    pinned    the enqueue that put the job in a worker's own queue    (the affinity mover: never moved while
              and may not move it elsewhere while that worker lives    its worker lives; gradsvc/broker/affinity.py)

The stored form is RQ's: a msgpack map in the job hash's `meta` field, the same bytes as before the fields
were typed, so jobs enqueued by an older API read the same.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gradsvc.wire import ErrorInfo, Progress

from . import keys


class ShardPlace(msgspec.Struct):
    """A shard's place in its job: the parent's id, its index of count, its rows of the batch."""

    parent: str
    index: int
    count: int
    rows: list[int]
    prefix: str = "gradsvc"
    owner: str | None = None


class JobMeta(msgspec.Struct, omit_defaults=True):
    owner: str | None = None
    shards: list[str] | None = None
    shard: ShardPlace | None = None
    progress: Progress | None = None
    error: ErrorInfo | None = None
    pinned: bool = False

    @classmethod
    def of(cls, meta: dict[str, Any] | None) -> JobMeta:
        """The typed fields of a job's meta (fields it does not know are left out)."""
        return msgspec.convert(meta or {}, cls) if meta else _EMPTY

    def as_meta(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @property
    def job_owner(self) -> str:
        """The job's owner; a shard's is in its place."""
        return self.owner or (self.shard.owner if self.shard else None) or keys.ANONYMOUS_OWNER

    @property
    def is_canceled(self) -> bool:
        return self.error is not None and self.error.code == "canceled"


_EMPTY = JobMeta()


def error_meta(code: str, message: str, detail: dict[str, Any] | None = None) -> dict[str, Any]:
    return msgspec.to_builtins(ErrorInfo(code=code, message=message, detail=detail or {}))


def set_error(job, error: dict[str, Any]) -> None:
    """Sets why the job failed (an error_meta) for a caller that saves the meta in a transaction of its own."""
    job.meta["error"] = error


def write_error(job, code: str, message: str, detail: dict[str, Any] | None = None) -> None:
    """Records why the job failed (its meta's `error`), saved at once."""
    set_error(job, error_meta(code, message, detail))
    job.save_meta()


def write_progress(job, phase: str, done: int, total: int) -> None:
    job.meta["progress"] = msgspec.to_builtins(Progress(phase=phase, done=done, total=total))
    job.save_meta()
