"""The job record RQ keeps in Redis: its serializer (MessagePack via msgspec, never pickle) and the Job
class that stores the request body uncompressed and writes the result in the success transaction."""

from __future__ import annotations

from typing import Any, Callable

import msgspec
from rq.job import Job
from rq.serializers import Serializer

# The job functions, by the dotted path RQ records and its worker imports: the API enqueues these names and
# imports nothing of workers/ (tests/workers/test_jobs.py pins each to its function).
GRADIENT_JOB = "workers.jobs.gradient_job"
SHARD_JOB = "workers.shards.shard_job"
REDUCE_JOB = "workers.shards.reduce_job"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def _msgpack_serializer() -> Serializer:
    """RQ's serializer for gradsvc queues: MessagePack via msgspec, so no pickle crosses Redis.

    An object of RQ's own Serializer protocol type, not an instance of a class of ours: RQ checks
    `isinstance(serializer, Serializer)` each time it makes a Job, a Queue, a registry or a Result (six
    times a job in the worker, and in the API's enqueue too), and Python 3.11 answers a runtime protocol's
    check by walking the protocol's attributes in Python: 21 us a check in a hot loop, 47 in a live
    worker. An object of the protocol's exact type is answered in C (0.2 us). RQ's worker records the
    serializer's dotted path (`__module__`.`__qualname__`), which names this module's attribute."""
    serializer = object.__new__(Serializer)  # a protocol's __init__ refuses instances; there is none to run
    serializer.dumps = _encoder.encode
    serializer.loads = _decoder.decode
    serializer.__module__, serializer.__qualname__ = __name__, "MsgpackSerializer"
    return serializer


MsgpackSerializer = _msgpack_serializer()


class GradientJob(Job):
    """RQ's Job, storing its data (the request body) uncompressed. RQ zlib-compresses it on every save, at
    enqueue and again when the job ends: ~40 MB/s on tensor bytes that do not compress, 55 ms per 2 MB on
    the path of every request (bench/medium_job.py). RQ's loader reads uncompressed data as it is."""

    # Set on a job read from Redis: its data is there already, and RQ's later saves of it (started,
    # finished, failed) rewrite every field: for a 33 MB request, one more 33 MB write at the end of the job.
    _data_stored = False
    # A result run_job hands over for the success transaction: (key, bytes, ttl) (see _handle_success).
    pending_result: tuple[str, bytes, int] | None = None
    result_flushed = False  # the pending result went into a transaction (flush_result)
    # A run's step to record with the result (gradsvc/broker/runs.py): a function adding its write to a pipeline.
    pending_step: "Callable[[Any], None] | None" = None

    def restore(self, raw_data) -> None:
        super().restore(raw_data)
        self._data_stored = True

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict:
        data = self.data
        self._data = b""  # what RQ compresses: nothing
        try:
            obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        finally:
            self._data = data
        if self._data_stored:
            del obj["data"]  # HSET keeps the stored field as it is
        else:
            obj["data"] = data
        return obj

    def _handle_success(self, result_ttl, pipeline, **kwargs) -> None:
        """RQ's success bookkeeping (status, results stream, FinishedJobRegistry), with the job's result
        written in the same transaction: one round trip less per job, and the result is in Redis the
        moment the results stream wakes the waiting API."""
        self.flush_result(pipeline)
        super()._handle_success(result_ttl, pipeline, **kwargs)

    def flush_result(self, connection) -> None:
        """Writes the pending result through `connection` (a pipeline: again on each retry of a transaction
        that a WatchError aborted; the worker drops it once the transaction went through)."""
        if self.pending_result is not None:
            key, data, ttl = self.pending_result
            connection.set(key, data, ex=ttl)
            self.result_flushed = True
        if self.pending_step is not None:
            self.pending_step(connection)
