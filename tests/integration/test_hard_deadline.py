"""A job that one long C++ op holds ends `timeout` or `canceled` within a bounded time: the
worker's heartbeat thread fails it and ends the process, and `gradsvc up` starts a fresh worker that serves
the next job. Through `gradsvc up` itself, since its supervisor is part of what is tested."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import pytest

from tests.support.stack import start_up, wait_ready, wait_status
from .test_reliability import small_body

JOB_TIMEOUT_S = 5
TERMINAL = ("finished", "failed", "canceled")
# Seconds past the timeout (or the cancel) within which the job must be reported: the hard-stop grace (2 s),
# the watchdog's tick (0.5 s), one poll, and slack for a loaded 2-core machine.
BOUND_S = 6


def wedging_body(n: int = 300_000) -> dict:
    """A 4-element parameter expanded to a [n, n, 4] view (no memory: a view) and summed: one C++ call over
    3.6e11 elements, minutes here (1.6e9 elements take ~2.3 s), that no Python-level timeout interrupts."""
    inputs = [{"name": "x", "kind": "input", "dtype": "float32", "shape": [-1, 4]},
              {"name": "p", "kind": "parameter", "target": "p", "dtype": "float32", "shape": [4]}]
    nodes = [{"name": "a", "op": "aten.add.Tensor", "args": [{"node": "x"}, {"node": "p"}]},
             {"name": "e", "op": "aten.expand.default", "args": [{"node": "p"}, [n, n, 4]]},
             {"name": "s", "op": "aten.sum.default", "args": [{"node": "e"}]},
             {"name": "o", "op": "aten.add.Tensor", "args": [{"node": "a"}, {"node": "s"}]}]
    graph = {"inputs": inputs, "nodes": nodes, "outputs": [{"node": "o"}], "dtype": "float32"}
    weights = {"p": {"dtype": "float32", "shape": [4], "data": [0.1, 0.2, 0.3, 0.4]}}
    return {"model": {"graph": graph, "dtype": "float32", "weights": weights}, "inputs": [[0.1, 0.2, 0.3, 0.4]],
            "targets": [[0.0] * 4], "loss": "mse", "options": {"numcheck": "off"}}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    proc, url = start_up(tmp, GRADSVC_JOB_TIMEOUT_S=str(JOB_TIMEOUT_S))
    http = httpx.Client(base_url=url, timeout=90)
    try:
        _wait_ready(http, tmp)
        yield http, tmp
    finally:
        http.close()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_ready(http: httpx.Client, tmp, timeout_s: float = 90) -> None:
    wait_ready(http, timeout_s, lambda: (tmp / "up.log").read_text())


def _submit_started(http: httpx.Client) -> str:
    r = http.post("/gradients?wait=0", json=wedging_body())
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    assert wait_status(http, job_id, ("started",) + TERMINAL)["status"] == "started"
    return job_id


def test_a_job_held_by_one_long_op_ends_timeout_within_its_deadline_and_a_new_worker_serves_the_next(up):
    http, tmp = up
    job_id = _submit_started(http)
    started = time.monotonic()  # a little after the worker took it
    job = wait_status(http, job_id, TERMINAL, JOB_TIMEOUT_S + BOUND_S)
    ended_s = time.monotonic() - started
    print(f"wedged job ended {job['status']} {job['error'] and job['error']['code']} {ended_s:.1f} s after it "
          f"started (timeout {JOB_TIMEOUT_S} s)")
    assert job["status"] == "failed", (job, (tmp / "up.log").read_text()[-3000:])
    assert job["error"]["code"] == "timeout" and job["error"]["detail"]["hard_stop"] is True
    t0 = time.monotonic()
    r = http.post("/gradients?wait=60", json=small_body())
    print(f"next job answered {r.status_code} {time.monotonic() - t0:.1f} s later (a restarted worker)")
    assert r.status_code == 200, r.text
    assert http.get("/readyz").json()["workers"] == 1  # the stopped worker is not counted


def test_a_canceled_job_held_by_one_long_op_ends_canceled_within_seconds_and_work_goes_on(up):
    http, tmp = up
    job_id = _submit_started(http)
    waiting = httpx.Client(base_url=str(http.base_url), timeout=90)
    t0 = time.monotonic()
    assert http.post(f"/jobs/{job_id}/cancel").status_code == 200
    job = wait_status(http, job_id, TERMINAL, BOUND_S)
    print(f"wedged job ended {job['status']} {time.monotonic() - t0:.1f} s after the cancel")
    assert job["status"] == "canceled" and job["error"]["code"] == "canceled", job
    r = waiting.post("/gradients?wait=60", json=small_body())
    waiting.close()
    assert r.status_code == 200, r.text
