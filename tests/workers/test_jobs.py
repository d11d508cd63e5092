"""workers/jobs.py's result buffer: each result is encoded into memory the worker used before, and a view of an
earlier result that outlived its job never blocks the next one."""

from __future__ import annotations

import msgspec

from gradsvc.wire import GradientResult, Tensor, Timings
from workers.jobs import ResultBuffer


def result(loss: float, size: int) -> GradientResult:
    return GradientResult(device="cpu", dtype="float32", parameter_count=size // 4, torch_version="", loss=loss,
                          gradients={"w": Tensor(dtype="float32", shape=[size // 4], data=bytes(size))},
                          timings=Timings())


def test_results_are_encoded_into_the_same_buffer_and_decode_to_what_was_encoded():
    buffers = ResultBuffer()
    first = buffers.encode(result(1.0, 1 << 20))
    address = id(buffers.buffer)
    assert msgspec.msgpack.decode(first, type=GradientResult).loss == 1.0
    buffers.release()
    second = buffers.encode(result(2.0, 1 << 19))
    assert id(buffers.buffer) == address and buffers.size == len(second)
    assert msgspec.msgpack.decode(second, type=GradientResult).loss == 2.0


def test_a_view_that_outlived_its_job_leaves_the_next_result_a_buffer_of_its_own():
    buffers = ResultBuffer()
    kept = buffers.encode(result(1.0, 4096))[:16]  # as an error's traceback might hold one
    buffers.release()
    again = buffers.encode(result(2.0, 4096))
    assert msgspec.msgpack.decode(again, type=GradientResult).loss == 2.0
    assert bytes(kept) == bytes(msgspec.msgpack.encode(result(1.0, 4096))[:16])


def test_a_result_past_keep_max_is_not_kept():
    buffers = ResultBuffer()
    buffers.KEEP_MAX = 1 << 16
    buffers.encode(result(1.0, 1 << 17))
    buffers.release()
    assert len(buffers.buffer) == 0


def test_the_dotted_paths_the_api_enqueues_name_the_job_functions():
    """The API enqueues the job functions by name (it imports nothing of workers/): each name resolves to
    the function RQ's worker will run."""
    from gradsvc.broker.job import GRADIENT_JOB, REDUCE_JOB, SHARD_JOB
    from rq.utils import import_attribute

    from workers.jobs import gradient_job
    from workers.shards import reduce_job, shard_job
    from gradsvc.broker.session_records import SESSION_JOB
    from workers.session_jobs import session_job
    assert [import_attribute(name) for name in (GRADIENT_JOB, SHARD_JOB, REDUCE_JOB, SESSION_JOB)] == \
        [gradient_job, shard_job, reduce_job, session_job]


def test_the_worker_context_owns_its_threads_and_files_and_ends_them_on_close(tmp_path):
    """No pool at import: the reaper and the handoff's writer threads are made with the worker's context
    (its process entry makes it) and ended by its close(), which deletes its spare result file too; its
    handoff reaches RQ's callbacks through the worker's Redis client, not a process global."""
    from concurrent.futures import ThreadPoolExecutor

    import pytest
    import redis

    from gradsvc.broker import handoff as handoff_module
    from gradsvc.runtime.settings import Settings
    from workers import jobs as jobs_module

    assert [name for module in (jobs_module, handoff_module) for name, value in vars(module).items()
            if isinstance(value, ThreadPoolExecutor)] == []
    handoff_dir = tmp_path / "handoff"
    conn = redis.Redis()  # never connected: the context makes no round trip
    ctx = jobs_module.make_context(Settings(worker_device="cpu", handoff_dir=str(handoff_dir)), conn)
    assert handoff_module.bound(conn) is ctx.handoff and ctx.handoff is not None
    assert handoff_module.bound(redis.Redis()) is None
    ctx.reaper.submit(ctx.spare.prepare, 4096).result(timeout=5)
    assert len(list(handoff_dir.glob(".spare-*"))) == 1
    ref = ctx.handoff.stage(b"x" * 100).commit("job-1", handoff_module.INPUT)
    assert ctx.handoff.get(ref) == b"x" * 100
    ctx.close()
    assert list(handoff_dir.glob(".spare-*")) == []
    with pytest.raises(RuntimeError):
        ctx.reaper.submit(print)
    with pytest.raises(RuntimeError):
        ctx.handoff.stage(b"y")
