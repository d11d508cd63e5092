"""The RQ side of sharding on a private redis-server, in this process: the fan-out's shape in Redis, and
the fan-in of a failure (a lost shard reaped from a thread, a failed shard whose callback never ran)."""

from __future__ import annotations

import threading
import time

import anyio
import msgspec
import pytest
import redis
from rq.group import Group
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from gradsvc.broker import keys
from gradsvc.runtime.settings import Settings
from gradsvc.wire import GradientRequest
from service.app import JobParts, job_parts
from gradsvc.broker.fanin import shard_job_id
from gradsvc.broker.job import MsgpackSerializer
from gradsvc.broker.leases import LeaseRegistry
from gradsvc.engine import EngineConfig, prepare

from tests.support.nets import SEED_A_LAYERS


@pytest.fixture()
def store(redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    s = job_parts(Settings(redis_url=redis_server.url, worker_heartbeat_s=1))
    yield s
    s.queues.redis.close()  # its async clients were used from loops that anyio.run has closed since


def sharded_job(store: JobParts, count: int = 3) -> tuple[str, list[str]]:
    req = msgspec.convert({"model": {"layers": SEED_A_LAYERS, "dtype": "float64"},
                           "inputs": [[0.1 * i] * 6 for i in range(10)], "targets": [i % 3 for i in range(10)],
                           "options": {"shards": count, "numcheck": "off"}}, GradientRequest)
    job_id, _ = store.enqueuer.enqueue(b"", "json", "auto", "owner", sharded=(req, prepare(req, EngineConfig(), "meta")))
    return job_id, [shard_job_id(job_id, k) for k in range(count)]


def info(store: JobParts, job_id: str):
    async def read():
        try:
            return await store.reader.info(job_id, "owner")
        finally:  # the next anyio.run is another event loop: leave no pooled connection bound to this one
            await store.queues.aredis.connection_pool.disconnect()

    return anyio.run(read)


def fetch(store: JobParts, job_id: str) -> Job:
    return Job.fetch(job_id, connection=store.queues.redis, serializer=MsgpackSerializer)


def test_fan_out_queues_every_shard_in_a_group_and_defers_the_reduce_job(store):
    job_id, ids = sharded_job(store)
    queued = [x.decode() for x in store.queues.redis.lrange("rq:queue:gradsvc", 0, -1)]
    assert queued == ids  # the reduce job is not queued: it waits on the shards
    assert fetch(store, job_id).get_status() == JobStatus.DEFERRED
    assert {j.id for j in Group.fetch(job_id, store.queues.redis).get_jobs()} == set(ids)
    shard = fetch(store, ids[2])
    assert shard.meta["shard"] == {"parent": job_id, "index": 2, "count": 3, "rows": [7, 10], "prefix": "gradsvc",
                                   "owner": "owner"}  # its graph_ref is looked up among this owner's graphs
    body = msgspec.msgpack.decode(shard.args[0], type=GradientRequest)
    assert body.options.shards == 1 and len(body.inputs) == 3 and body.targets == [1, 2, 0]
    job = info(store, job_id)
    assert job.status == "queued" and job.progress.phase == "shards" and job.progress.total == 3


def _lose(store: JobParts, shard_id: str) -> None:
    """shard_id as a worker that died mid-job leaves it: started, its lease long lapsed."""
    shard = fetch(store, shard_id)
    store.queues.redis.lrem("rq:queue:gradsvc", 0, shard_id)
    shard.set_status(JobStatus.STARTED)
    store.queues.redis.zadd(StartedJobRegistry("gradsvc", connection=store.queues.redis).key,
                     {f"{shard_id}:lost-execution": time.time() - 60})


def _reap_in_a_thread(registry_class, store: JobParts) -> None:
    t = threading.Thread(target=lambda: registry_class("gradsvc", connection=store.queues.redis,
                                                       serializer=MsgpackSerializer).cleanup())
    t.start()
    t.join(30)


def test_a_lost_shard_reaped_from_a_heartbeat_thread_fails_the_job_worker_lost_and_cancels_the_rest(store):
    job_id, ids = sharded_job(store)
    _lose(store, ids[1])
    _reap_in_a_thread(LeaseRegistry, store)
    job = fetch(store, job_id)
    assert job.get_status() == JobStatus.FAILED
    error = job.meta["error"]
    assert error["code"] == "worker_lost" and error["detail"]["shard"] == 1 and "shard 1 of 3" in error["message"]
    assert [fetch(store, s).get_status() for s in (ids[0], ids[2])] == [JobStatus.CANCELED] * 2
    assert store.queues.redis.llen("rq:queue:gradsvc") == 0
    assert store.queues.redis.exists(keys.cancel_key("gradsvc", job_id))
    assert store.queues.redis.xlen(keys.rq_results_stream(job_id)) == 1  # what a waiting POST wakes on
    read = info(store, job_id)
    assert read.status == "failed" and read.error.code == "worker_lost"


def test_rqs_own_registry_reaping_from_a_thread_would_leave_the_job_waiting_forever(store):
    """Why LeaseRegistry exists: RQ times failure callbacks with SIGALRM, which a thread cannot set."""
    job_id, ids = sharded_job(store)
    _lose(store, ids[0])
    _reap_in_a_thread(StartedJobRegistry, store)
    assert fetch(store, ids[0]).get_status() == JobStatus.FAILED
    assert fetch(store, job_id).get_status() == JobStatus.DEFERRED
    # Reading the job repairs it: the API runs the fan-in for a failed shard whose job still waits.
    read = info(store, job_id)
    assert read.status == "failed" and read.error.code == "worker_lost" and read.error.detail["shard"] == 0


def test_a_failed_shard_names_its_code_and_delete_cancels_every_shard(store):
    job_id, ids = sharded_job(store)
    shard = fetch(store, ids[2])
    shard.meta["error"] = {"code": "non_finite", "message": "the loss is inf", "detail": {"layer": "0"}}
    shard.save_meta()
    shard.set_status(JobStatus.FAILED)  # as if its failure callback had been cut short
    read = info(store, job_id)
    assert read.status == "failed" and read.error.code == "non_finite"
    assert read.error.detail == {"layer": "0", "shard": 2, "shards": 3, "shard_job_id": ids[2]}

    other, other_ids = sharded_job(store)
    store.reader.cancel(other)
    assert fetch(store, other).get_status() == JobStatus.CANCELED
    assert all(fetch(store, s).get_status() == JobStatus.CANCELED for s in other_ids)
    assert info(store, other).status == "canceled"
