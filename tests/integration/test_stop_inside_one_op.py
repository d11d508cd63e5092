"""SIGTERM and DELETE reach a job that one long C++ op holds (issue 24), on a two-worker stack that serves other
jobs throughout: the wedged job is reported (`worker_lost` after SIGTERM, `canceled` after DELETE), never left
`started`, and the worker holding it ends (its Python signal handlers cannot run inside the op: the heartbeat
thread sees the signal through the wakeup fd, workers/worker.py)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from redis import Redis
from rq.job import Job

from ..stack import client_fixtures, start_stack, wait_started, wait_status
from .test_hard_deadline import TERMINAL, wedging_body
from .test_reliability import small_body

# Seconds within which the wedged job must be reported: the grace (TERM_GRACE_S 5 s, CANCEL_GRACE_S 2 s), the
# watchdog's tick, one poll, and slack for a loaded 2-core machine.
BOUND_S = 15


@pytest.fixture(scope="module")
def two_workers():
    s = start_stack(workers=2, GRADSVC_WORKER_HEARTBEAT_S="1")
    yield s
    s.stop()


http, redis = client_fixtures("two_workers")


def _wedge(http, redis: Redis, stack) -> tuple[str, subprocess.Popen]:
    """A wedged job, started: its id and the worker process that holds it."""
    r = http.post("/gradients?wait=0", json=wedging_body())
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    assert wait_started(redis, [job_id], 1) == [job_id]
    name = redis.hget(Job.key_for(job_id), "worker_name").decode()
    pid = int(name.split("-")[-2])  # gradsvc-<kind>-<host>-<pid>-<index>
    return job_id, next(p for p in stack.workers if p.pid == pid)


def _serves_others(http, n: int = 3) -> None:
    for _ in range(n):
        r = http.post("/gradients?wait=60", json=small_body())
        assert r.status_code == 200, r.text


def _replace(stack, proc: subprocess.Popen) -> None:
    stack.workers.remove(proc)
    stack.start_worker()
    stack.wait_ready(2)


def test_sigterm_to_a_worker_inside_one_long_op_ends_it_and_reports_its_job_worker_lost(http, redis, two_workers):
    job_id, proc = _wedge(http, redis, two_workers)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _serves_others(http)  # the other worker, meanwhile
    job = wait_status(http, job_id, TERMINAL, BOUND_S)
    print(f"wedged job ended {job['status']} {job.get('error') and job['error']['code']} "
          f"{time.monotonic() - t0:.1f} s after SIGTERM")
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", (job, two_workers.logs()[-3000:])
    assert job["error"]["detail"]["hard_stop"] is True
    assert proc.wait(timeout=BOUND_S) == 128 + signal.SIGTERM
    _serves_others(http, 1)
    _replace(two_workers, proc)


def test_delete_of_a_job_inside_one_long_op_ends_it_canceled_while_the_other_worker_serves(http, redis, two_workers):
    job_id, proc = _wedge(http, redis, two_workers)
    t0 = time.monotonic()
    assert http.delete(f"/jobs/{job_id}").status_code == 200
    _serves_others(http)
    job = wait_status(http, job_id, TERMINAL, BOUND_S)
    print(f"wedged job ended {job['status']} {time.monotonic() - t0:.1f} s after DELETE")
    assert job["status"] == "canceled" and job["error"]["code"] == "canceled", job
    proc.wait(timeout=BOUND_S)  # ended for its supervisor to restart (here: the test)
    _serves_others(http, 1)
    _replace(two_workers, proc)
