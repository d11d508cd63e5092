"""Affinity routing on a real Redis: a job of a held model goes to its holder's own queue while the holder is alive;
a job that waited past its time there, or a pinned one whose worker is gone, moves to the front of its fallback
queue exactly once, whoever runs the mover and however many run it at once."""

from __future__ import annotations

import threading
import time

from rq import Queue
from rq.job import Job

from gradsvc.broker import affinity, keys
from gradsvc.broker.job import GradientJob, MsgpackSerializer
from gradsvc.wire import GradientRequest, Tensor

PREFIX = "gradsvc"


def _queue(redis, name: str) -> Queue:
    return Queue(name, connection=redis, serializer=MsgpackSerializer, job_class=GradientJob)


def _enqueue(redis, mover: affinity.Mover, own: str, fallback: str, job_id: str, wait_s: float,
             pinned: bool = False) -> None:
    with redis.pipeline() as pipe:
        _queue(redis, own).enqueue("builtins.print", "x", job_id=job_id, pipeline=pipe)
        mover.track(pipe, job_id, fallback, wait_s, pinned=pinned)
        pipe.execute()


def _alive(redis, name: str) -> None:
    redis.hset(keys.rq_worker_key(name), "last_heartbeat", "now")  # RQ's worker key is a hash
    redis.expire(keys.rq_worker_key(name), 30)


def _stopped(redis, name: str) -> None:
    """As RQ's register_death leaves a worker that stopped: its key kept 60 s, with its death."""
    redis.hset(keys.rq_worker_key(name), "death", "now")
    redis.expire(keys.rq_worker_key(name), 60)


def test_route_goes_to_the_live_holders_own_queue_else_the_fallback(flushed_redis):
    redis = flushed_redis
    key = "layers:float32:abc"
    assert affinity.route(redis, PREFIX, "alice", key, "gradsvc") == "gradsvc"  # nobody holds it
    affinity.record_holder(redis, PREFIX, "alice", key, "w1", ttl_s=60)
    assert affinity.holder(redis, PREFIX, "alice", key) == "w1"
    assert affinity.route(redis, PREFIX, "alice", key, "gradsvc") == "gradsvc"  # w1 is not alive
    _alive(redis, "w1")
    assert affinity.worker_alive(redis, "w1") and not affinity.worker_alive(redis, "w2")
    assert affinity.route(redis, PREFIX, "alice", key, "gradsvc") == keys.own_queue_name(PREFIX, "w1")
    assert affinity.route(redis, PREFIX, "bob", key, "gradsvc") == "gradsvc"  # another owner: not its model
    assert affinity.route(redis, PREFIX, "alice", None, "gradsvc") == "gradsvc"
    _stopped(redis, "w1")  # stopped (SIGTERM): its key stays 60 s, but it is gone
    assert not affinity.worker_alive(redis, "w1")
    assert affinity.route(redis, PREFIX, "alice", key, "gradsvc") == "gradsvc"


def test_model_key_names_structure_and_dtype_not_weights():
    import msgspec

    def req(dtype="float32", out=3, w=None):
        return msgspec.convert({"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": out}],
                                          "dtype": dtype, **({"weights": w} if w else {})},
                                "inputs": [[1.0, 2.0]], "targets": [0], "loss": "cross_entropy"}, GradientRequest)

    assert affinity.model_key(req()) == affinity.model_key(req(w={"0.bias": {"dtype": "float32", "shape": [3], "data": [0.0, 0.0, 0.0]}}))
    assert affinity.model_key(req()) != affinity.model_key(req(dtype="float64"))
    assert affinity.model_key(req()) != affinity.model_key(req(out=4))


def test_a_frozen_bases_key_names_its_pieces_shapes_and_dtype_not_its_parameter_names(flushed_redis):
    def base(names, refs=("a1", "a2"), shape=(4, 4)):
        return {n: Tensor(dtype="float32", shape=list(shape), refs=list(refs)) for n in names}
    key = affinity.base_key("float32", base(["model.w"]))
    assert key == affinity.base_key("float32", base(["base_model.model.w"]))  # peft renames, the pieces are one
    assert key != affinity.base_key("float64", base(["model.w"]))
    assert key != affinity.base_key("float32", base(["model.w"], refs=("a1", "b2")))
    assert key != affinity.base_key("float32", base(["model.w"], shape=(2, 8)))
    assert affinity.base_key("float32", {}) is None
    affinity.record_holder(flushed_redis, PREFIX, affinity.BASES, key, "w1", 60)
    affinity.drop_holder(flushed_redis, PREFIX, affinity.BASES, key, "w2")  # another worker's record stays
    assert affinity.holder(flushed_redis, PREFIX, affinity.BASES, key) == "w1"
    affinity.drop_holder(flushed_redis, PREFIX, affinity.BASES, key, "w1")
    assert affinity.holder(flushed_redis, PREFIX, affinity.BASES, key) is None


def test_a_job_waiting_past_its_time_moves_once_to_the_front_of_its_fallback(flushed_redis):
    redis = flushed_redis
    mover = affinity.Mover(redis, PREFIX)
    own = keys.own_queue_name(PREFIX, "busy-worker")
    _alive(redis, "busy-worker")
    _queue(redis, "gradsvc").enqueue("builtins.print", "y", job_id="already-there")
    _enqueue(redis, mover, own, "gradsvc", "j1", wait_s=0.2)
    assert mover.move_overdue() == []  # not yet due
    assert _queue(redis, own).job_ids == ["j1"]
    time.sleep(0.3)
    movers = [affinity.Mover(redis, PREFIX) for _ in range(4)]
    moved: list[list[str]] = []
    threads = [threading.Thread(target=lambda m=m: moved.append(m.move_overdue())) for m in movers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(sum(moved, [])) == ["j1"]  # one mover moved it, the others found nothing
    assert _queue(redis, own).job_ids == []
    assert _queue(redis, "gradsvc").job_ids == ["j1", "already-there"]  # at the front: it waited already
    job = Job.fetch("j1", connection=redis, serializer=MsgpackSerializer)
    assert job.origin == "gradsvc" and job.get_status() == "queued"
    assert redis.zcard(keys.affinity_waiting_key(PREFIX)) == 0 and redis.hlen(keys.affinity_fallback_key(PREFIX)) == 0


def test_a_job_taken_by_its_worker_is_not_moved(flushed_redis):
    redis = flushed_redis
    mover = affinity.Mover(redis, PREFIX)
    own = keys.own_queue_name(PREFIX, "w")
    _alive(redis, "w")
    _enqueue(redis, mover, own, "gradsvc", "j2", wait_s=0.0)
    assert redis.lpop(keys.rq_queue_key(own)) == b"j2"  # the worker's dequeue won
    assert mover.move_overdue() == []
    assert _queue(redis, "gradsvc").job_ids == []
    assert redis.zcard(keys.affinity_waiting_key(PREFIX)) == 1  # being started: still tracked (its worker may die)
    redis.hset(Job.key_for("j2"), "status", "started")
    assert mover.move_overdue() == [] and _queue(redis, "gradsvc").job_ids == []
    assert redis.zcard(keys.affinity_waiting_key(PREFIX)) == 0  # started: its record went


def test_a_pinned_job_stays_while_its_worker_lives_and_moves_when_it_is_gone(flushed_redis):
    redis = flushed_redis
    mover = affinity.Mover(redis, PREFIX)
    own = keys.own_queue_name(PREFIX, "holder")
    _alive(redis, "holder")
    _enqueue(redis, mover, own, "gradsvc-cuda", "p1", wait_s=0.0, pinned=True)
    time.sleep(0.05)
    assert mover.move_overdue() == []
    assert _queue(redis, own).job_ids == ["p1"]
    redis.delete(keys.rq_worker_key("holder"))  # its lease lapsed
    assert mover.move_overdue() == ["p1"]
    assert _queue(redis, "gradsvc-cuda").job_ids == ["p1"] and _queue(redis, own).job_ids == []
    assert mover.move_overdue() == []


def test_a_pinned_job_of_a_stopped_worker_moves_though_rq_keeps_its_key(flushed_redis):
    redis = flushed_redis
    mover = affinity.Mover(redis, PREFIX)
    own = keys.own_queue_name(PREFIX, "holder")
    _alive(redis, "holder")
    _enqueue(redis, mover, own, "gradsvc-cpu", "p2", wait_s=0.0, pinned=True)
    assert mover.move_overdue() == []
    _stopped(redis, "holder")
    assert mover.move_overdue() == ["p2"]
    assert _queue(redis, "gradsvc-cpu").job_ids == ["p2"] and _queue(redis, own).job_ids == []


def test_a_gone_workers_own_queue_is_emptied_in_order_at_once_and_forgotten(flushed_redis):
    """Whatever its jobs' waits: killed (its key lapsed) or stopped (its death written), a worker's own queue goes
    to the front of the jobs' fallbacks in its order, and its name out of RQ's set of queues; a live worker's
    stays."""
    redis = flushed_redis
    mover = affinity.Mover(redis, PREFIX)
    for name in ("killed", "stopped", "alive"):
        _alive(redis, name)
    killed, stopped, alive = (keys.own_queue_name(PREFIX, n) for n in ("killed", "stopped", "alive"))
    _queue(redis, "gradsvc").enqueue("builtins.print", "y", job_id="already-there")
    for job_id in ("k1", "k2"):
        _enqueue(redis, mover, killed, "gradsvc", job_id, wait_s=3600)
    _enqueue(redis, mover, killed, "gradsvc-cpu", "k3", wait_s=0.0, pinned=True)
    _enqueue(redis, mover, stopped, "gradsvc-cuda", "s1", wait_s=3600)
    _enqueue(redis, mover, alive, "gradsvc", "a1", wait_s=3600)
    _queue(redis, killed).enqueue("builtins.print", "z", job_id="untracked")  # none recorded: to the default
    _queue(redis, killed).enqueue("builtins.print", "z", job_id="expired")
    redis.delete(Job.key_for("expired"))  # its record expired: dropped
    assert mover.sweep_gone("gradsvc") == 0 and mover.move_overdue() == []  # every holder alive, nothing due
    redis.delete(keys.rq_worker_key("killed"))
    _stopped(redis, "stopped")
    assert mover.sweep_gone("gradsvc") == 5
    assert _queue(redis, "gradsvc").job_ids == ["k1", "k2", "untracked", "already-there"]
    assert _queue(redis, "gradsvc-cpu").job_ids == ["k3"] and _queue(redis, "gradsvc-cuda").job_ids == ["s1"]
    assert Job.fetch("k1", connection=redis, serializer=MsgpackSerializer).origin == "gradsvc"
    assert Job.fetch("s1", connection=redis, serializer=MsgpackSerializer).origin == "gradsvc-cuda"
    names = {q.name for q in Queue.all(connection=redis)}
    assert killed not in names and stopped not in names and alive in names
    assert not redis.exists(keys.rq_queue_key(killed)) and _queue(redis, alive).job_ids == ["a1"]
    assert set(map(bytes.decode, redis.hkeys(keys.affinity_fallback_key(PREFIX)))) == {"a1"}
    assert redis.scard(keys.affinity_pinned_key(PREFIX)) == 0
    assert mover.sweep_gone("gradsvc") == 0 and mover.move_overdue() == []


def test_what_a_killed_worker_took_from_its_own_queue_and_never_started_is_queued_again(flushed_redis):
    """RQ takes a job by moving it into the queue's intermediate list; a worker killed before the job started
    left it there, and RQ's own cleanup of that list runs only on the list's worker: the job waited forever
    (a session step answered 202 until its session expired). The sweep queues it again; a started one is left to
    its lease (worker_lost)."""
    redis = flushed_redis
    mover = affinity.Mover(redis, PREFIX)
    _alive(redis, "killed")
    own = keys.own_queue_name(PREFIX, "killed")
    for job_id in ("taken", "running"):
        _enqueue(redis, mover, own, "gradsvc-cpu", job_id, wait_s=0.0, pinned=True)
        redis.lmove(keys.rq_queue_key(own), f"{keys.rq_queue_key(own)}:intermediate", "LEFT", "RIGHT")
    redis.hset(Job.key_for("running"), "status", "started")
    redis.delete(keys.rq_worker_key("killed"))
    assert mover.sweep_gone("gradsvc") == 1
    assert _queue(redis, "gradsvc-cpu").job_ids == ["taken"]
    assert not redis.exists(f"{keys.rq_queue_key(own)}:intermediate")
    assert Job.fetch("taken", connection=redis, serializer=MsgpackSerializer).origin == "gradsvc-cpu"


def test_a_pinned_job_its_worker_took_and_never_started_is_queued_again_once_that_worker_is_gone(flushed_redis):
    """RQ takes a job from several queues with BLPOP: a worker killed between taking a job and starting it left it
    in no list, queued; the pinned job was dropped from tracking and waited forever (a session step answered 202).
    While its worker lives it is being started and stays tracked; once the worker is gone it is queued again."""
    redis = flushed_redis
    mover = affinity.Mover(redis, PREFIX)
    _alive(redis, "holder")
    own = keys.own_queue_name(PREFIX, "holder")
    _enqueue(redis, mover, own, "gradsvc-cpu", "taken", wait_s=0.0, pinned=True)
    _enqueue(redis, mover, own, "gradsvc-cpu", "started", wait_s=0.0, pinned=True)
    redis.delete(keys.rq_queue_key(own))  # both taken by the worker (BLPOP): in no list
    redis.hset(Job.key_for("started"), "status", "started")
    assert mover.move_overdue() == []  # alive: it is starting "taken" now
    assert redis.sismember(keys.affinity_pinned_key(PREFIX), "taken")
    assert not redis.sismember(keys.affinity_pinned_key(PREFIX), "started")  # started: its lease's from now on
    _enqueue(redis, mover, own, "gradsvc-cpu", "in-a-take", wait_s=0.0, pinned=True)
    redis.lmove(keys.rq_queue_key(own), keys.taken_key(PREFIX, "holder"), "LEFT", "RIGHT")  # takes.py took it
    redis.delete(keys.rq_worker_key("holder"))  # killed before it started "taken"
    assert mover.move_overdue() == ["taken"]  # the take's job is the takes reaper's to give back: once, not twice
    assert _queue(redis, "gradsvc-cpu").job_ids == ["taken"]
    assert set(map(bytes.decode, redis.smembers(keys.affinity_pinned_key(PREFIX)))) == {"in-a-take"}
