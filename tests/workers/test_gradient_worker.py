"""GradientWorker in this process on a private redis-server: job leases, out-of-memory, and the proof that
no pickle crosses Redis and weights never go through torch.load."""

from __future__ import annotations

import copy
import importlib
import pickle
import re
import threading
import time
import zlib
from pathlib import Path

import msgspec
import pytest
import redis
import torch
from rq import Queue
from rq.job import Job
from rq.registry import StartedJobRegistry

from gradsvc.broker import keys
from gradsvc.runtime.settings import Settings
from gradsvc.wire import GradientRequest, GradientResult
from service.app import JobParts, job_parts
from workers import jobs as worker_jobs
from gradsvc.broker.job import MsgpackSerializer
from workers.worker import GradientWorker

from tests.support.nets import SEED_A_LAYERS
from tests.support.stack import ROOT

engine_compute = importlib.import_module("gradsvc.engine.compute")


@pytest.fixture()
def settings(redis_server) -> Settings:
    redis.Redis.from_url(redis_server.url).flushdb()
    return Settings(redis_url=redis_server.url, worker_heartbeat_s=1, worker_metrics_port=0,
                    worker_device="cpu")


@pytest.fixture()
def make_worker(settings):
    """GradientWorker(s) on the auto queue, each with the context its process entry would make (closed after
    the test)."""
    contexts = []

    def make(heartbeat_s: int = 1) -> tuple[GradientWorker, Queue]:
        conn = redis.Redis.from_url(settings.redis_url)
        queue = Queue(keys.queue_name(settings.queue_prefix, "auto"), connection=conn, serializer=MsgpackSerializer)
        contexts.append(worker_jobs.make_context(settings, conn))
        worker = GradientWorker([queue], connection=conn, serializer=MsgpackSerializer, heartbeat_s=heartbeat_s,
                                context=contexts[-1])
        return worker, queue

    yield make
    for ctx in contexts:
        ctx.close()


def seed_a_request(**options) -> dict:
    return {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
            "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
            "loss": "cross_entropy", "options": {"numcheck": "off", **options}}


def enqueue_gradients(store: JobParts, body: dict) -> str:
    job_id, _ = store.enqueuer.enqueue(msgspec.json.encode(body), "json", "auto", "owner-1")
    return job_id


def test_a_job_running_longer_than_its_lease_is_renewed_not_reaped(settings, make_worker):
    worker, queue = make_worker(heartbeat_s=1)  # lease: 3 s
    job = queue.enqueue("time.sleep", 5.0, job_timeout=60)
    reaped = threading.Event()
    stop = threading.Event()

    def reaper() -> None:  # another worker's (or the API's) reaper, running all the time
        registry = StartedJobRegistry(queue.name, connection=queue.connection, serializer=MsgpackSerializer)
        while not stop.is_set():
            registry.cleanup()
            if job.get_status(refresh=True) == "failed":
                reaped.set()
            time.sleep(0.2)

    t = threading.Thread(target=reaper, daemon=True)
    t.start()
    try:
        started = time.monotonic()
        worker.work(burst=True, logging_level="WARNING")
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        t.join()
    print(f"job ran {elapsed:.1f} s against a 3 s lease")
    assert elapsed >= 5.0
    assert not reaped.is_set()
    assert job.get_status(refresh=True) == "finished"


def test_a_lapsed_lease_is_failed_as_abandoned_and_the_api_reports_worker_lost(settings, make_worker):
    import anyio

    store = job_parts(settings)
    worker, queue = make_worker(heartbeat_s=1)
    job_id = enqueue_gradients(store, seed_a_request())
    job = Job.fetch(job_id, connection=queue.connection, serializer=MsgpackSerializer)
    # What a worker killed mid-job leaves behind: the job started, leased for 3 s, never renewed.
    worker.register_birth()
    queue.connection.lpop(queue.key)
    worker.prepare_execution(job)
    worker.prepare_job_execution(job)
    assert job.get_status(refresh=True) == "started"
    time.sleep(3 + 1.5)  # the lease, and the API's one-second grace
    info = anyio.run(lambda: store.reader.info(job_id, "owner-1"))
    assert info.status == "failed"
    assert info.error.code == "worker_lost"
    assert "submit it again" in info.error.message


def test_one_idempotency_key_enqueues_one_job_even_from_8_threads_at_once(settings):
    from concurrent.futures import ThreadPoolExecutor

    store = job_parts(settings)
    body = msgspec.json.encode(seed_a_request())
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: store.enqueuer.enqueue(body, "json", "auto", "owner-1", "key-1"), range(8)))
    assert len({job_id for job_id, _ in answers}) == 1 and sum(created for _, created in answers) == 1
    queue = store.queues.shared["auto"]
    assert queue.count == 1 and queue.job_ids == [answers[0][0]]
    other_owner, created = store.enqueuer.enqueue(body, "json", "auto", "owner-2", "key-1")  # keys are per owner
    assert created and other_owner != answers[0][0] and queue.count == 2
    ttl = store.queues.redis.ttl(keys.idempotency_key(settings.queue_prefix, "owner-1", "key-1"))
    assert 0 < ttl <= settings.idempotency_ttl_s


@pytest.mark.parametrize("exc", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                                 MemoryError("cannot allocate 20 GiB")])
def test_out_of_memory_fails_the_job_with_advice_and_the_worker_goes_on(settings, make_worker, monkeypatch, exc):
    real = engine_compute._compute
    calls = []

    def oom_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_compute, "_compute", oom_once)
    store = job_parts(settings)
    first = enqueue_gradients(store, seed_a_request())
    second = enqueue_gradients(store, seed_a_request())
    worker, queue = make_worker()
    worker.work(burst=True, logging_level="WARNING")

    failed = Job.fetch(first, connection=queue.connection, serializer=MsgpackSerializer)
    assert failed.get_status() == "failed"
    error = failed.meta["error"]
    assert error["code"] == "out_of_memory"
    assert "micro_batch" in error["message"] and "checkpoint_segments" in error["message"]
    assert Job.fetch(second, connection=queue.connection, serializer=MsgpackSerializer).get_status() == "finished"
    result = msgspec.msgpack.decode(queue.connection.get(keys.result_key(settings.queue_prefix, second)),
                                    type=GradientResult)
    assert result.parameter_count == 83
    assert len(calls) == 2


def test_jobs_cross_redis_as_msgpack_never_pickle(settings, make_worker):
    store = job_parts(settings)
    assert all(q.serializer is MsgpackSerializer for q in store.queues.shared.values())
    job_id = enqueue_gradients(store, seed_a_request())
    worker, queue = make_worker()
    assert worker.serializer is MsgpackSerializer
    worker.work(burst=True, logging_level="WARNING")

    conn = queue.connection
    fields = conn.hgetall(f"rq:job:{job_id}")
    data = fields[b"data"]
    try:
        data = zlib.decompress(data)  # RQ's Job compresses the call; workers.jobs.GradientJob does not
    except zlib.error:
        pass
    for name, raw in ((b"data", data), (b"meta", fields[b"meta"])):
        assert not raw.startswith(b"\x80"), f"{name} looks like a pickle"  # pickle protocol 2+ header
        msgspec.msgpack.decode(raw)  # and it is MessagePack
    func, _instance, args, _kwargs = msgspec.msgpack.decode(data)
    assert func == "workers.jobs.gradient_job"
    assert msgspec.json.decode(args[0], type=GradientRequest).model.layers[0]["type"] == "Linear"
    # Anything stored under a job is readable without pickle: no key holds a pickle header.
    for key in conn.keys("*"):
        kind = conn.type(key)
        values = ([conn.get(key)] if kind == b"string" else conn.hvals(key) if kind == b"hash" else
                  [v for _, entry in conn.xrange(key) for v in entry.values()] if kind == b"stream" else [])
        assert not any(v.startswith(b"\x80\x04") or v.startswith(b"\x80\x05") for v in values if v), key


def test_a_jobs_leftover_memory_is_handed_back_by_the_heartbeat_thread_once_the_worker_idles(settings, make_worker):
    """The worker's MemoryKeeper sees each job end (after_job) and its heartbeat thread trims while no job runs:
    here any excess counts (slack -1), and the real malloc_trim runs once, after the job, not during it."""
    store = job_parts(settings)
    worker, _queue = make_worker()
    keeper = worker.memory
    keeper.slack_bytes, keeper.idle_s = -1, 0.2
    trims, real_trim = [], keeper._trim
    keeper._trim = lambda pad: trims.append((worker.leases.running is None, time.monotonic())) or real_trim(pad)
    enqueue_gradients(store, seed_a_request())
    worker.work(burst=True, logging_level="WARNING")  # the job ends: a trim is due, not done
    due = keeper.due_since  # when the job ended, leaving its excess
    assert due is not None and trims == []
    worker.leases.start()
    try:
        deadline = time.monotonic() + 10
        while not trims and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.leases.stop()
        worker.watchdog.thread.join(5)  # no heartbeat of this worker's left to land in another test's Redis
    assert len(trims) == 1 and trims[0][0], trims  # once, while idle
    assert trims[0][1] - due >= 0.2 and keeper.due_since is None  # idle_s after the job's end


def test_weights_never_go_through_torch_load_or_pickle(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.load / pickle used on request data")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    body = seed_a_request()
    body["model"]["weights"] = {name: {"dtype": "float64", "shape": list(p.shape), "data": p.tolist()}
                                for name, p in model.state_dict().items()}
    result = engine_compute.compute(msgspec.convert(body, GradientRequest))
    assert result.parameter_count == 83
    # And nothing in the service, the workers or the SDK calls them at all.
    pattern = re.compile(r"\btorch\.load\(|\bimport pickle\b|\bpickle\.loads?\(|\bcloudpickle\b|\bdill\b")
    offenders = [str(p.relative_to(ROOT)) for d in ("service", "workers", "gradsvc", "gradclient")
                 for p in (ROOT / d).rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
    assert Path(ROOT / "gradsvc" / "broker" / "job.py").read_text().count("msgspec.msgpack") >= 2


def burst_commands(settings: Settings, n: int, take: int = 1) -> tuple[dict, list[str]]:
    """Redis's calls by command that a worker taking `take` at once made to run n queued seed-A jobs in a burst
    (from the server's commandstats), and the jobs' ids."""
    import dataclasses

    from workers.main import build_worker

    store = job_parts(settings)
    conn = store.queues.redis
    ids = [enqueue_gradients(store, seed_a_request()) for _ in range(n)]
    before = {k: v["calls"] for k, v in conn.info("commandstats").items()}
    # One heartbeat a run (its first, at the start): no more beats while a longer run goes on.
    worker = build_worker(dataclasses.replace(settings, worker_take=take, worker_heartbeat_s=60))
    try:
        worker.work(burst=True, logging_level="WARNING")
    finally:
        worker.context.close()
    after = {k: v["calls"] for k, v in conn.info("commandstats").items()}
    return {k[len("cmdstat_"):]: after[k] - before.get(k, 0) for k in after}, ids


def test_a_job_costs_the_worker_two_transactions_and_keeps_every_rq_record(settings):
    """The worker's per-job Redis traffic (GradientWorker's overrides): one transaction before the job and one
    after it, no WATCH or read of a dependents set, no per-job suspension check, the job's data not written
    again; and every record RQ keeps for a job is still there."""
    from rq.registry import FinishedJobRegistry
    from rq.results import Result

    from gradsvc.broker.job import GradientJob
    from workers.main import build_worker

    store = job_parts(settings)
    conn = store.queues.redis
    one, _ = burst_commands(settings, 1)
    seven, ids = burst_commands(settings, 7)
    per_job = {k: (seven.get(k, 0) - one.get(k, 0)) / 6 for k in set(one) | set(seven)}
    # Per-run work may differ by one command between the two runs (registry maintenance): 1/6 per job here.
    near = lambda name, n: abs(per_job.get(name, 0) - n) <= 1 / 6 + 1e-9  # noqa: E731
    assert near("exec", 2), per_job  # before the job and after it
    assert per_job.get("watch", 0) < 0.5 and per_job.get("smembers", 0) < 0.5, per_job
    assert per_job.get("exists", 0) < 0.5, per_job  # rq suspend is checked at most once a second
    assert near("set", 1) and near("hgetall", 1), per_job  # the result; the job, read once
    for job_id in ids:
        job = GradientJob.fetch(job_id, connection=conn, serializer=MsgpackSerializer)
        assert job.get_status() == "finished"
        assert job.args[1] == "json" and msgspec.json.decode(job.args[0])["loss"] == "cross_entropy"
        assert job_id in FinishedJobRegistry(queue=store.queues.shared["auto"]).get_job_ids()
        assert Result.fetch_latest(job, serializer=MsgpackSerializer).type == Result.Type.SUCCESSFUL
        assert conn.get(keys.result_key(settings.queue_prefix, job_id))
        assert job.last_heartbeat is not None and job.ended_at is not None
    named = build_worker(settings)
    named.context.close()
    worker_hash = conn.hgetall(f"rq:worker:{named.name}")
    assert not worker_hash or worker_hash.get(b"state") in (None, b"idle")


def test_the_start_transaction_runs_before_the_job_and_its_reply_is_read_when_the_job_ends(settings, make_worker,
                                                                                          monkeypatch):
    """The worker sends its start transaction and reads the reply when the job ends: while the job runs, Redis
    has already marked it started (registry, status, lease); a refused command in it surfaces as an error at
    the job's end, and its connection goes back to the pool either way."""
    from workers.transaction import SentTransaction

    store = job_parts(settings)
    worker, queue = make_worker()
    seen = {}
    real = worker_jobs.run_job

    def spy(*args, **kwargs):
        job_id = seen["id"]
        seen["status"] = store.queues.redis.hget(Job.key_for(job_id), "status")
        seen["started"] = job_id in StartedJobRegistry(queue=queue).get_job_ids()
        seen["pending"] = worker._started is not None
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_jobs, "run_job", spy)
    seen["id"] = enqueue_gradients(store, seed_a_request())
    worker.work(burst=True, logging_level="WARNING")
    assert seen == {"id": seen["id"], "status": b"started", "started": True, "pending": True}
    assert worker._started is None and Job.fetch(seen["id"], connection=store.queues.redis).get_status() == "finished"

    conn = redis.Redis.from_url(settings.redis_url)
    pool = conn.connection_pool
    conn.set("a-string", "x")
    pipe = conn.pipeline()
    pipe.set("k1", "v1")
    pipe.hset("a-string", "f", "v")  # WRONGTYPE at EXEC
    pipe.set("k2", "v2")
    sent = SentTransaction(pipe)
    assert not pipe.command_stack
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        sent.settle()
    assert conn.get("k1") == b"v1" and conn.get("k2") == b"v2"  # Redis ran the rest, as MULTI/EXEC does
    pipe.set("k3", "v3")
    pipe.execute_command("NO-SUCH-COMMAND")  # refused when queued: EXEC aborts, nothing runs
    sent = SentTransaction(pipe)
    with pytest.raises(redis.ResponseError):
        sent.settle()
    assert conn.get("k3") is None
    pipe.incr("n")
    SentTransaction(pipe).settle()
    assert conn.get("n") == b"1" and conn.ping()
    assert len(pool._in_use_connections) == 0  # every connection went back


# A plain RQ SimpleWorker waits 60 s here before it ends: in `make test-all`; GradientWorker without the context
# `gradsvc worker` makes fails its jobs the same way in `make test`.
@pytest.mark.parametrize("plain", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["rq-simpleworker", "gradientworker-without-context"])
def test_a_job_taken_by_a_worker_gradsvc_did_not_start_fails_saying_how_workers_are_started(settings, monkeypatch,
                                                                                            plain):
    """The job functions get their state from the worker running them, never from the environment: a worker
    made without the context `gradsvc worker` makes (a plain `rq worker`, or GradientWorker alone) fails each
    job with a coded error saying so, and stays up."""
    import anyio
    from rq.worker import SimpleWorker

    from gradsvc.broker.job import GradientJob

    def no_environment(*args, **kwargs):
        raise AssertionError("a job built the worker's state from the environment")

    monkeypatch.setattr(Settings, "from_env", no_environment)
    store = job_parts(settings)
    job_ids = [enqueue_gradients(store, seed_a_request()) for _ in range(2)]
    conn = redis.Redis.from_url(settings.redis_url)
    queue = Queue(keys.queue_name(settings.queue_prefix, "auto"), connection=conn, serializer=MsgpackSerializer,
                  job_class=GradientJob)
    worker_class = SimpleWorker if plain else GradientWorker
    worker = worker_class([queue], connection=conn, serializer=MsgpackSerializer, job_class=GradientJob)
    worker.work(burst=True, logging_level="WARNING")
    async def read_all() -> list:
        return [await store.reader.info(job_id, "owner-1") for job_id in job_ids]

    for job_id, info in zip(job_ids, anyio.run(read_all)):  # both taken: the worker went on after the first
        assert info.status == "failed"
        assert info.error.code == "internal_error"
        assert "gradsvc worker" in info.error.message and "rq worker" in info.error.message
        assert conn.get(keys.result_key(settings.queue_prefix, job_id)) is None


def test_a_take_computed_together_keeps_every_rq_record_as_a_job_alone(settings):
    """A take of 8 (GRADSVC_WORKER_TAKE) computed together (workers/combining.py): each job whose result was kept
    is started and ended in one transaction (its start held: workers/worker.py prepare_job_execution) and not
    read a second time as it starts (workers/taking.py); its RQ record, registries and result end as a job's
    alone: the same hash fields, finished, in the finished registry and no other, its execution gone."""
    from rq.registry import FinishedJobRegistry, StartedJobRegistry
    from rq.results import Result

    from gradsvc.broker.job import GradientJob
    from workers.main import build_worker

    fixed, (solo,) = burst_commands(settings, 1)  # one job's two transactions and read, and a run's own upkeep
    calls, ids = burst_commands(settings, 8, take=8)
    jobs = {k: calls.get(k, 0) - fixed.get(k, 0) for k in ("exec", "hgetall")}  # the 8 jobs' share, less one job's
    conn = redis.Redis.from_url(settings.redis_url)
    queue = Queue(keys.queue_name(settings.queue_prefix, "auto"), connection=conn, serializer=MsgpackSerializer)
    decode = msgspec.msgpack.Decoder(GradientResult).decode
    combined = [decode(conn.get(keys.result_key(settings.queue_prefix, j))).combined for j in ids]
    assert sum(1 for c in combined if c) >= 7, combined  # one take: the first job and the 7 behind it, together
    # 2 + 7 transactions: the first job's two, one for each kept result (2 x 8 without); each job read once
    assert jobs["exec"] + 2 < 2 * 8 - 4 and jobs["hgetall"] + 1 <= 8, calls
    finished, started = FinishedJobRegistry(queue=queue).get_job_ids(), StartedJobRegistry(queue=queue).get_job_ids()

    def record(job_id: str) -> dict:
        job = GradientJob.fetch(job_id, connection=conn, serializer=MsgpackSerializer)
        latest = Result.fetch_latest(job, serializer=MsgpackSerializer)
        return {"fields": sorted(conn.hkeys(job.key)), "status": job.get_status(), "ttl": conn.ttl(job.key) > 0,
                "worker": job.worker_name is not None, "started": job.started_at is not None,
                "ended": job.ended_at is not None, "heartbeat": job.last_heartbeat is not None,
                "finished registry": job_id in finished, "started registry": job_id in started,
                "result": latest.type, "executions": conn.exists(f"rq:executions:{job_id}")}

    alone = record(solo)
    assert alone["status"] == "finished" and alone["finished registry"] and not alone["started registry"]
    for job_id in ids:
        assert record(job_id) == alone, job_id
    assert not conn.exists(keys.taken_key(settings.queue_prefix, build_worker(settings).name))


def test_a_sigterm_while_the_end_transaction_is_written_stops_the_worker_after_the_job_finished(settings, make_worker,
                                                                                              monkeypatch):
    """RQ's warm shutdown asks the worker's state: a SIGTERM landing while the success transaction's replies are read
    (the worker's IDLE state in it) must still find the worker busy, or RQ raises StopRequested inside the
    transaction and a job whose end was written is failed over it."""
    import signal

    from rq.registry import FailedJobRegistry

    worker, queue = make_worker()
    job_id = enqueue_gradients(job_parts(settings), seed_a_request())
    real = redis.client.Pipeline.execute

    def execute(pipe, *args, **kwargs):
        ending = any(cmd[0] == "XADD" for cmd, _ in pipe.command_stack)  # the end transaction: the results stream
        out = real(pipe, *args, **kwargs)
        if ending:
            worker.request_stop(signal.SIGTERM, None)  # as the signal's handler runs while the replies are read
        return out

    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    try:
        worker.work(burst=False, logging_level="WARNING")  # returns once stopped: after the job, warm
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    job = Job.fetch(job_id, connection=queue.connection, serializer=MsgpackSerializer)
    assert job.get_status() == "finished"
    assert job_id not in FailedJobRegistry(queue=queue).get_job_ids()
