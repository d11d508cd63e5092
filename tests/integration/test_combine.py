"""A take's jobs computed together (workers/combining.py, gradsvc/engine/combine.py) on a live stack (a private
redis-server, the API over HTTP, a real RQ worker taking 8): each job answers what it answers alone (layer specs
and a graph model, float32 and float64, several losses, a per-sample job left alone), a job whose values fail
among good ones fails alone with its own code, and a worker killed with SIGKILL while it keeps combined results
for its take loses none of the jobs and runs none twice: they are queued again and computed alone."""

from __future__ import annotations

import signal
import time

import msgspec
import pytest
import torch

from gradsvc.broker import keys
from gradsvc.engine import Engine
from gradsvc.wire import GradientRequest
from tests.integration.test_reliability import TERMINAL, long_body, submit
from tests.integration.test_takes import _starts
from tests.support.combine_cases import (assert_equal_results, graph_bodies, layer_body, mse_body,
                                         overflowing_body)
from tests.support.stack import start_stack, wait_status

_decode = msgspec.json.Decoder(GradientRequest)


@pytest.fixture(scope="module")
def take_stack():
    s = start_stack(workers=1, GRADSVC_WORKER_TAKE="8", GRADSVC_WORKER_HEARTBEAT_S="1", GRADSVC_LOG_LEVEL="info")
    yield s
    s.stop()


def _taken_together(s, bodies: list[dict]) -> list[dict]:
    """The bodies submitted while the worker is stopped, so that it dequeues the first and takes the rest: each
    job's view once ended."""
    worker = s.workers[0]
    with s.http_client(timeout=60) as http:
        worker.send_signal(signal.SIGSTOP)
        try:
            ids = [submit(http, b) for b in bodies]
        finally:
            worker.send_signal(signal.SIGCONT)
        return [wait_status(http, j, TERMINAL, 60) for j in ids]


def _alone(body: dict) -> dict:
    return msgspec.to_builtins(Engine().compute(_decode.decode(msgspec.json.encode(body)), device=torch.device("cpu")))


def test_layer_specs_in_two_dtypes_equal_alone(take_stack):
    bodies = [layer_body(i, "float64") for i in range(4)] + [layer_body(i, "float32") for i in range(4)]
    jobs = _taken_together(take_stack, bodies)
    assert [j["status"] for j in jobs] == ["finished"] * 8, jobs
    # memory is asked for (the default): each dtype's first job runs alone, metered; the others carry its report
    assert [j["result"]["combined"] for j in jobs] == [None, 3, 3, 3] * 2
    for body, job in zip(bodies, jobs):
        assert_equal_results(_alone(body), job["result"], body["model"]["dtype"])


def test_a_graph_model_and_several_losses_equal_alone(take_stack):
    bodies = graph_bodies(4, "float32") + [layer_body(i, "float64", {"memory": False}, losses=True) for i in range(4)]
    jobs = _taken_together(take_stack, bodies)
    assert [j["status"] for j in jobs] == ["finished"] * 8, jobs
    assert [j["result"]["combined"] for j in jobs] == [None, 3, 3, 3, 4, 4, 4, 4]
    for body, job in zip(bodies, jobs):
        assert_equal_results(_alone(body), job["result"], body["model"]["dtype"])


def test_only_the_failing_job_fails_and_a_per_sample_job_computes_alone(take_stack):
    per_sample = layer_body(5, "float32", {"per_sample": "norms"})
    bodies = [mse_body(1), mse_body(2), overflowing_body(), mse_body(3), per_sample]
    jobs = _taken_together(take_stack, bodies)
    assert [j["status"] for j in jobs] == ["finished", "finished", "failed", "finished", "finished"], jobs
    assert jobs[2]["error"]["code"] == "non_finite"
    assert [j["result"]["combined"] for j in jobs if j["status"] == "finished"] == [None, 3, 3, None]
    for body, job in zip(bodies, jobs):
        if job["status"] == "finished":
            assert_equal_results(_alone(body), job["result"], "float32")
    assert jobs[4]["result"]["per_sample"] is not None


def test_a_worker_killed_keeping_combined_results_loses_none_and_runs_none_twice(take_stack):
    """The long job is dequeued; the 7 small ones taken with it are computed together as it starts and kept; the
    worker is killed while the long job runs: the small ones go back to the queue and compute alone, once."""
    s = take_stack
    worker = s.workers[0]
    with s.http_client(timeout=60) as http, s.redis_client() as r:
        worker.send_signal(signal.SIGSTOP)
        try:
            blocker = submit(http, long_body())
            small = [submit(http, layer_body(i, "float64")) for i in range(7)]
        finally:
            worker.send_signal(signal.SIGCONT)
        assert wait_status(http, blocker, ("started",))["status"] == "started"
        deadline = time.monotonic() + 30
        while "6 of 8 taken jobs computed together" not in s.logs() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "6 of 8 taken jobs computed together" in s.logs(), s.logdir
        assert r.llen(keys.taken_key("gradsvc", _worker_name(r))) == 7  # none started yet
        assert [http.get(f"/jobs/{j}").json()["status"] for j in small] == ["queued"] * 7  # kept: still queued
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        s.start_worker()
        ended = {j: wait_status(http, j, TERMINAL, 90) for j in [blocker, *small]}
    assert ended[blocker]["status"] == "failed" and ended[blocker]["error"]["code"] == "worker_lost"
    assert [ended[j]["status"] for j in small] == ["finished"] * 7, ended
    starts = _starts(s)
    assert all(starts[j] == 1 for j in small) and starts[blocker] == 1, starts
    for i, j in enumerate(small):  # the kept results died with the worker: the next one computed the jobs
        assert_equal_results(_alone(layer_body(i, "float64")), ended[j]["result"], "float64")


def _worker_name(r) -> str:
    names = [k.decode().removeprefix("rq:worker:") for k in r.keys("rq:worker:gradsvc-*")]
    names = [n for n in names if ":" not in n]
    assert len(names) == 1, names
    return names[0]
