"""Training runs' storage (gradsvc/broker/runs.py) on a private Redis: a job records its step once, however often
its write is replayed; steps, runs and exports stay within their bounds; the record script writes exactly the keys
gradsvc/broker/keys.py names."""

from __future__ import annotations

import msgspec
import pytest

from gradsvc.broker import keys
from gradsvc.broker.runs import RunBounds, RunStore
from gradsvc.wire import RunCheck, RunStep


@pytest.fixture()
def r(flushed_redis):
    return flushed_redis


def store(r, **bounds) -> RunStore:
    return RunStore(r, "test", RunBounds(**bounds))


def step(n: int, job_id: str, loss: float = 1.0) -> RunStep:
    return RunStep(step=n, job_id=job_id, ended_at="", loss=loss, grad_norm=2.0, module_grad_norms={"0": 2.0},
                   total_ms=1.0)


def test_a_jobs_step_is_recorded_once_however_often_its_write_is_replayed(r):
    s = store(r)
    for _ in range(3):
        s.record(r, "alice", "job-1", step(0, "job-1"), "exp", numbered=True)
    with r.pipeline() as pipe:  # as the success transaction replays it after a WatchError
        s.record(pipe, "alice", "job-1", step(5, "job-1"), "exp", numbered=True)
        pipe.execute()
    assert [(x.step, x.job_id) for x in s.steps("alice", "exp")] == [(0, "job-1")]
    assert s.job_run("job-1") == ("exp", 0)


def test_steps_without_a_number_follow_the_runs_last_and_a_repeated_number_replaces_its_step(r):
    s = store(r)
    for i in range(3):
        s.record(r, "alice", f"job-{i}", step(0, f"job-{i}"), "exp", numbered=False)
    s.record(r, "alice", "job-again", step(1, "job-again", loss=7.0), "exp", numbered=True)
    got = [(x.step, x.job_id, x.loss) for x in s.steps("alice", "exp")]
    assert got == [(0, "job-0", 1.0), (1, "job-again", 7.0), (2, "job-2", 1.0)]


def test_a_run_keeps_its_newest_steps_up_to_the_bound(r):
    s = store(r, max_steps=3)
    for i in range(5):
        s.record(r, "alice", f"job-{i}", step(i, f"job-{i}"), "exp", numbered=True)
    assert [x.step for x in s.steps("alice", "exp")] == [2, 3, 4]


def test_an_owner_keeps_its_most_recently_stepped_runs_up_to_the_bound_and_evicted_runs_leave_no_key(r):
    s = store(r, max_runs=2)
    for i, name in enumerate(["a", "b", "c"]):
        s.record(r, "alice", f"job-{i}", step(0, f"job-{i}"), name, numbered=True, weights=b"w")
    assert [x.name for x in s.runs("alice")] == ["c", "b"]
    assert s.steps("alice", "a") is None
    assert not r.exists(keys.run_key("test", "alice", "a", "steps"), keys.run_key("test", "alice", "a", "weights"))
    assert {m.decode() for m in r.zrange(keys.run_exports_key("test"), 0, -1)} == {"alice b", "alice c"}


def test_the_record_script_writes_the_keys_keys_py_names_with_the_runs_ttl(r):
    s = store(r, ttl_s=1234)
    s.record(r, "alice", "job-1", step(0, "job-1"), "exp <1>", numbered=True, weights=b"weights")
    steps_key = keys.run_key("test", "alice", "exp <1>", "steps")
    weights_key = keys.run_key("test", "alice", "exp <1>", "weights")
    assert r.zcard(steps_key) == 1 and s.previous_weights("alice", "exp <1>") == b"weights"
    for key in (steps_key, weights_key, keys.runs_key("test", "alice"), keys.run_job_key("test", "job-1")):
        assert 1200 < r.ttl(key) <= 1234, key


def test_a_step_without_weights_drops_the_previous_ones(r):
    s = store(r)
    s.record(r, "alice", "job-1", step(0, "job-1"), "exp", numbered=True, weights=b"old")
    s.record(r, "alice", "job-2", step(1, "job-2"), "exp", numbered=True)
    assert s.previous_weights("alice", "exp") is None  # the next ratio would compare non-adjacent steps


def test_runs_are_per_owner_and_delete_removes_every_trace(r):
    s = store(r)
    s.record(r, "alice", "job-1", step(0, "job-1"), "exp", numbered=True, weights=b"w")
    assert s.runs("bob") == [] and s.steps("bob", "exp") is None and not s.delete("bob", "exp")
    assert s.delete("alice", "exp")
    assert s.runs("alice") == [] and s.steps("alice", "exp") is None and s.exported(10, 60) == []
    assert s.previous_weights("alice", "exp") is None


def test_exports_are_the_most_recently_stepped_runs_within_the_idle_time(r):
    s = store(r)
    for i in range(3):
        s.record(r, "alice", f"job-{i}", step(i, f"job-{i}", loss=float(i)), f"run-{i}", numbered=True)
    assert [(e.name, e.last.loss) for e in s.exported(2, 60)] == [("run-2", 2.0), ("run-1", 1.0)]
    r.zadd(keys.run_exports_key("test"), {"alice run-2": 1.0})  # stepped long ago: idle
    assert [e.name for e in s.exported(5, 60)] == ["run-1", "run-0"]


def test_a_step_recorded_with_the_check_off_reads_back_with_no_verdict_even_one_stored_as_false(r):
    s = store(r)
    for n, passed in enumerate((None, False)):  # False: as steps were recorded before "off" said null
        off = msgspec.structs.replace(step(n, f"job-{n}"), numcheck=RunCheck("off", passed, 0.0))
        s.record(r, "alice", f"job-{n}", off, "exp", numbered=True)
    assert [x.numcheck.passed for x in s.steps("alice", "exp")] == [None, None]


def test_an_unnumbered_step_past_the_largest_step_number_is_not_recorded(r):
    """The API refuses it before the queue (422); the script holds the bound too, for two steps racing there."""
    from gradsvc.wire import MAX_RUN_STEP

    s = store(r)
    s.record(r, "alice", "job-top", step(MAX_RUN_STEP, "job-top"), "exp", numbered=True)
    s.record(r, "alice", "job-next", step(0, "job-next"), "exp", numbered=False)
    assert [x.step for x in s.steps("alice", "exp")] == [MAX_RUN_STEP]
    assert s.job_run("job-next") is None
    assert s.usage("alice", "exp").last_step == MAX_RUN_STEP


def test_the_owners_run_weights_are_counted_per_run_and_dropped_with_their_runs(r):
    s = store(r, max_runs=2)
    s.record(r, "alice", "j0", step(0, "j0"), "a", numbered=True, weights=b"w" * 100)
    s.record(r, "alice", "j1", step(0, "j1"), "b", numbered=True, weights=b"w" * 40)
    s.record(r, "alice", "j2", step(1, "j2"), "a", numbered=True, weights=b"w" * 70)
    assert s.weights_bytes("alice") == 110 and s.usage("alice", "a").other_weights_bytes == 40
    s.record(r, "alice", "j3", step(0, "j3"), "c", numbered=True, weights=b"w" * 5)  # evicts run "b"
    assert s.weights_bytes("alice") == 75
    s.delete("alice", "a")
    assert s.weights_bytes("alice") == 5 and s.weights_bytes("bob") == 0
    s.record(r, "alice", "j4", step(1, "j4"), "c", numbered=True)  # no weights: none kept, none counted
    assert s.weights_bytes("alice") == 0


def test_weights_over_the_owners_budget_are_not_kept(r):
    s = store(r, weights_budget_bytes=100)
    s.record(r, "alice", "j0", step(0, "j0"), "a", numbered=True, weights=b"w" * 60)
    s.record(r, "alice", "j1", step(0, "j1"), "b", numbered=True, weights=b"w" * 60)
    assert s.weights_bytes("alice") == 60 and s.previous_weights("alice", "b") is None
    assert [x.step for x in s.steps("alice", "b")] == [0]  # the step itself is recorded
