"""The queue side of a sharded request (service/fan_out.py fans it out): the shard job (its rows,
computed as any job), the reduce job (the shards' results -> the job's result) and the fan-in of a
failure (a failed or lost shard fails the job, naming itself, and cancels its siblings).

A failure reaches `gradsvc.broker.fanin.shard_failed` through RQ's on_failure callback, from the worker that ran the shard
or, for a shard whose worker died, from whichever process reaps its lapsed lease (a worker's
heartbeat thread, or the API reading the job): both reap through `LeaseRegistry`.
"""

from __future__ import annotations

import logging
import time

import msgspec
from rq.job import Job

from gradsvc.broker import handoff as handoff_files
from gradsvc.broker import keys
from gradsvc.broker.record import JobMeta
from gradsvc.engine import ComputeError
from gradsvc.engine import tensors
from gradsvc.engine.reduce import ShardPlan, add_reduce_time, check_combined, reduce_results
from gradsvc.wire import GradientResult, Tensor

from .jobs import JobCanceledError, WorkerContext, compute_request, run_job, store_value

log = logging.getLogger("gradsvc.worker")
_result_decoder = msgspec.msgpack.Decoder(GradientResult)
_reference_decoder = msgspec.msgpack.Decoder(dict[str, Tensor])
_encoder = msgspec.msgpack.Encoder()


def shard_job(body: bytes | str) -> dict:
    """One shard: a normal request over its rows (its bytes, or a handoff ref); its result goes to its own
    result key for the reduce job."""

    def work(job: Job, ctx: WorkerContext, queue_s: float) -> GradientResult:
        parent = JobMeta.of(job.meta).shard.parent
        reference: dict = {}
        result = compute_request(job, ctx, body, "msgpack", queue_s, cancel_id=parent, reference=reference)
        if reference:  # the float64 autograd gradients of its rows, for the combined returned-gradient check
            store_value(job, ctx, keys.reference_key(ctx.settings.queue_prefix, job.id), handoff_files.REFERENCE,
                        _encoder.encode({n: tensors.encode(t) for n, t in reference.items()}))
        if job.connection.exists(keys.cancel_key(ctx.settings.queue_prefix, parent)):
            raise JobCanceledError()  # the job was canceled or a sibling failed while this one ran
        return result

    return run_job(work, kind="shard")


def reduce_job(plan: dict, shard_ids: list[str]) -> dict:
    """Runs once every shard has finished (an RQ Dependency on all of them): combines their results into
    the job's result and deletes theirs."""

    def work(job: Job, ctx: WorkerContext, queue_s: float) -> GradientResult:
        started = time.perf_counter()
        prefix = ctx.settings.queue_prefix
        shard_keys = [keys.result_key(prefix, sid) for sid in shard_ids]
        # A shard's result (and reference) is its key's value, or the handoff file its marker names.
        raws = [handoff_files.load(raw, ctx.handoff) for raw in job.connection.mget(shard_keys)]
        missing = [k for k, raw in enumerate(raws) if raw is None]
        if missing:
            raise ComputeError("internal_error", f"the results of shards {missing} expired before they could be "
                               "combined (GRADSVC_RESULT_TTL_S); submit the job again", shards=missing)
        results = [_result_decoder.decode(raw) for raw in raws]
        del raws
        shard_plan = ShardPlan(**plan)
        result = reduce_results(results, shard_plan)
        # The proof covers the sum: the combined gradient, as returned, against the shards' float64
        # references combined with the same shares (the float64 gradient of the whole batch).
        reference_keys = [keys.reference_key(prefix, sid) for sid in shard_ids]
        references = [None if raw is None else _reference_decoder.decode(raw)
                      for raw in (handoff_files.load(r, ctx.handoff) for r in job.connection.mget(reference_keys))]
        check_combined(result, references, shard_plan, results)
        add_reduce_time(result, 1e3 * (time.perf_counter() - started))
        job.connection.delete(*shard_keys, *reference_keys)
        if ctx.handoff is not None:
            for sid in shard_ids:
                ctx.handoff.discard(sid)
        return result

    return run_job(work, kind="reduce")
