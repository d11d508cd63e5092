"""Taking several jobs at once on a real Redis (gradsvc/broker/takes.py): a take moves ids from the queue's front to
the worker's taken list atomically; a stopping worker, or any worker's heartbeat for a gone one, puts them back at
the front of their queues in their order, exactly once, however many give back at once; a deleted or canceled job
is dropped."""

from __future__ import annotations

import threading

from rq import Queue

from gradsvc.broker import keys
from gradsvc.broker.job import GradientJob, MsgpackSerializer
from gradsvc.broker.takes import Takes

PREFIX = "gradsvc"


def _queue(redis, name: str = "gradsvc") -> Queue:
    return Queue(name, connection=redis, serializer=MsgpackSerializer, job_class=GradientJob)


def _fill(redis, n: int, name: str = "gradsvc") -> list[str]:
    q = _queue(redis, name)
    return [q.enqueue("builtins.print", i, job_id=f"job-{name}-{i}").id for i in range(n)]


def test_a_take_moves_up_to_n_ids_from_the_front_and_gives_them_back_in_order(flushed_redis):
    redis = flushed_redis
    ids = _fill(redis, 5)
    takes = Takes(redis, PREFIX, "w1")
    assert takes.take("gradsvc", 3) == ids[:3]
    assert _queue(redis).get_job_ids() == ids[3:]
    assert [i.decode() for i in redis.lrange(keys.taken_key(PREFIX, "w1"), 0, -1)] == ids[:3]
    assert redis.sismember(keys.takers_key(PREFIX), "w1")
    assert takes.take("gradsvc", 10) == ids[3:]  # fewer queued than asked: what there is
    assert takes.take("gradsvc", 10) == []
    assert takes.give_back() == 5
    assert _queue(redis).get_job_ids() == ids
    assert not redis.exists(keys.taken_key(PREFIX, "w1"))
    assert not redis.sismember(keys.takers_key(PREFIX), "w1")


def test_a_take_is_at_most_the_workers_share_of_the_queue(flushed_redis):
    redis = flushed_redis
    ids = _fill(redis, 7)
    for name in ("w1", "w2", "w3"):
        redis.sadd(keys.rq_queue_workers_key("gradsvc"), keys.rq_worker_key(name))
    assert Takes(redis, PREFIX, "w1").take("gradsvc", 8) == ids[:2]  # 7 queued, 3 workers: 2 each
    assert Takes(redis, PREFIX, "w2").take("gradsvc", 8) == ids[2:3]  # 5 left: 1
    assert Takes(redis, PREFIX, "w3").take("gradsvc", 1) == ids[3:4]  # 4 left: 1, as asked


def test_reap_gives_back_only_the_gone_workers_takes_and_drops_deleted_jobs(flushed_redis):
    redis = flushed_redis
    ids = _fill(redis, 6)
    alive, gone = Takes(redis, PREFIX, "alive"), Takes(redis, PREFIX, "gone")
    redis.set(keys.rq_worker_key("alive"), b"1", ex=30)
    assert alive.take("gradsvc", 2) == ids[:2]
    assert gone.take("gradsvc", 3) == ids[2:5]
    redis.delete(GradientJob.key_for(ids[3]))  # deleted while taken
    GradientJob.fetch(ids[4], connection=redis, serializer=MsgpackSerializer).cancel()  # canceled while taken
    assert alive.reap() == 3
    assert _queue(redis).get_job_ids() == [ids[2], ids[5]]
    assert [i.decode() for i in redis.lrange(keys.taken_key(PREFIX, "alive"), 0, -1)] == ids[:2]
    assert alive.reap() == 0  # once


def test_many_reapers_at_once_give_each_job_back_once(flushed_redis):
    redis = flushed_redis
    ids = _fill(redis, 40)
    for w in range(8):
        Takes(redis, PREFIX, f"gone{w}").take("gradsvc", 5)
    assert _queue(redis).get_job_ids() == []
    counts: list[int] = []
    threads = [threading.Thread(target=lambda: counts.append(Takes(redis, PREFIX, "x").reap())) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(counts) == 40
    assert sorted(_queue(redis).get_job_ids()) == sorted(ids)
