"""Lost workers, lost Redis, timeouts, cancellation, result TTL and size: each on its own real stack
(a private redis-server, the API over HTTP, real RQ workers), since these tests kill and restart things."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.nets import SEED_A_LAYERS
from tests.support.stack import Stack, start_stack, start_up, wait_ready, wait_status

HEARTBEAT_S = 2  # a job lease is 3 heartbeats: 6 s
TERMINAL = ("finished", "failed", "canceled")


def small_body(**options) -> dict:
    return {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
            "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
            "loss": "cross_entropy", "options": {"numcheck": "off", **options}}


def long_body() -> dict:
    """Minutes of work (an exact numerical check of 263k parameters) that reports progress as it goes."""
    layers: list[dict] = []
    for _ in range(4):
        layers += [{"type": "Linear", "in_features": 256, "out_features": 256}, {"type": "Tanh"}]
    return {"model": {"layers": layers, "dtype": "float64", "seed": 0}, "inputs": [[0.1] * 256] * 16,
            "targets": [[0.0] * 256] * 16, "loss": "mse", "options": {"numcheck": "exact"}}


def submit(http: httpx.Client, body: dict) -> str:
    r = http.post("/gradients?wait=0", json=body)
    assert r.status_code == 202, r.text
    return r.json()["job_id"]



@pytest.fixture(scope="module")
def limits_stack():
    s = start_stack(workers=1, GRADSVC_WORKER_HEARTBEAT_S=str(HEARTBEAT_S), GRADSVC_JOB_TIMEOUT_S="12",
                    GRADSVC_RESULT_TTL_S="3", GRADSVC_MAX_RESULT_BYTES="300000")
    yield s
    s.stop()


@pytest.fixture()
def lhttp(limits_stack: Stack):
    with limits_stack.http_client(timeout=60) as client:
        yield client


@pytest.mark.slow  # make test-all; see docs/testing.md
def test_a_job_running_past_many_heartbeats_is_not_abandoned_and_ends_with_timeout(lhttp, limits_stack):
    job_id = submit(lhttp, long_body())
    seen, started = [], time.monotonic()
    while time.monotonic() - started < 40:
        job = lhttp.get(f"/jobs/{job_id}").json()
        seen.append(job["status"])
        if job["status"] in TERMINAL:
            break
        time.sleep(0.25)
    elapsed = time.monotonic() - started
    print(f"long job ran {elapsed:.1f} s (lease {3 * HEARTBEAT_S} s) and ended {job['status']} {job['error']}")
    assert set(seen[:-1]) <= {"queued", "started"}
    assert job["status"] == "failed"
    assert job["error"]["code"] == "timeout", job["error"]  # not worker_lost: its lease was renewed throughout
    assert elapsed > 3 * 3 * HEARTBEAT_S / 2  # it outlived its lease more than once
    assert limits_stack.workers[0].poll() is None


def test_timeout_while_waiting_answers_504_with_the_job_id(lhttp):
    r = lhttp.post("/gradients?wait=30", json=long_body())
    assert r.status_code == 504, r.text
    body = r.json()
    assert body["error"]["code"] == "timeout" and body["status"] == "failed" and body["job_id"]
    assert "GRADSVC_JOB_TIMEOUT_S" in body["error"]["message"] or "timeout" in body["error"]["message"]


def test_cancel_stops_a_queued_job_at_once_and_a_running_one_at_its_next_step(lhttp):
    running = submit(lhttp, long_body())
    assert wait_status(lhttp, running, ("started",))["status"] == "started"
    queued = submit(lhttp, small_body())
    assert lhttp.get(f"/jobs/{queued}").json()["status"] == "queued"

    r = lhttp.post(f"/jobs/{queued}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "canceled"
    assert r.json()["error"]["code"] == "canceled"

    t0 = time.monotonic()
    assert lhttp.post(f"/jobs/{running}/cancel").status_code == 200
    job = wait_status(lhttp, running, TERMINAL, 30)
    print(f"running job stopped {time.monotonic() - t0:.2f} s after the cancel")
    assert job["status"] == "canceled" and job["error"]["code"] == "canceled"

    after = submit(lhttp, small_body())
    assert wait_status(lhttp, after, TERMINAL)["status"] == "finished"
    job = lhttp.get(f"/jobs/{queued}").json()
    assert job["status"] == "canceled" and job["started_at"] is None  # the worker never ran it
    assert lhttp.post(f"/jobs/{queued}/cancel").json()["status"] == "canceled"  # a second cancel is harmless


def test_a_result_is_gone_after_its_ttl(lhttp):
    r = lhttp.post("/gradients?wait=30", json=small_body())
    assert r.status_code == 200
    job_id = r.json()["job_id"]
    assert lhttp.get(f"/jobs/{job_id}").json()["status"] == "finished"
    time.sleep(3 + 1.5)
    r = lhttp.get(f"/jobs/{job_id}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_result_above_the_size_limit_fails_with_result_too_large_and_the_worker_goes_on(lhttp, limits_stack):
    body = small_body()
    body["model"]["layers"] = [{"type": "Linear", "in_features": 6, "out_features": 256}, {"type": "Tanh"},
                               {"type": "Linear", "in_features": 256, "out_features": 256}, {"type": "Tanh"},
                               {"type": "Linear", "in_features": 256, "out_features": 3}]
    r = lhttp.post("/gradients?wait=30", json=body)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "result_too_large" and error["detail"]["limit"] == 300000
    assert error["detail"]["result_bytes"] > 300000
    job = lhttp.get(f"/jobs/{r.json()['job_id']}").json()
    assert job["status"] == "failed" and job["error"]["code"] == "result_too_large"
    assert lhttp.post("/gradients?wait=30", json=small_body()).status_code == 200
    assert limits_stack.workers[0].poll() is None


# --- faults: a worker killed mid-job, Redis stopped and started again ------------------------------------
@pytest.fixture()
def fault_stack():
    datadir = tempfile.mkdtemp(prefix="gradsvc-redis-")
    # Redis keeps its data across the restart (append-only file), as a production Redis would.
    s = start_stack(workers=1, redis_args=("--appendonly", "yes", "--appendfsync", "always", "--dir", datadir),
                    GRADSVC_WORKER_HEARTBEAT_S=str(HEARTBEAT_S), GRADSVC_REDIS_TIMEOUT_S="1")
    yield s
    s.stop()


@pytest.mark.slow  # make test-all; see docs/testing.md
def test_killed_worker_and_restarted_redis_leave_every_job_terminal_and_work_resumes(fault_stack):
    s = fault_stack
    http = httpx.Client(base_url=s.base_url, timeout=30)
    jobs: list[str] = []

    # 1. SIGKILL the worker in the middle of a job.
    victim = submit(http, long_body())
    jobs.append(victim)
    assert wait_status(http, victim, ("started",))["status"] == "started"
    jobs += [submit(http, small_body()) for _ in range(3)]  # queued behind it
    s.workers[0].send_signal(signal.SIGKILL)
    s.workers[0].wait()
    t0 = time.monotonic()
    job = wait_status(http, victim, TERMINAL, 60)
    print(f"killed worker's job ended {job['status']} {job['error'] and job['error']['code']} "
          f"{time.monotonic() - t0:.1f} s after SIGKILL")
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost"
    assert time.monotonic() - t0 < 60

    s.start_worker()  # what `gradsvc up` does for a dead worker (tested below)
    for job_id in jobs[1:]:
        assert wait_status(http, job_id, TERMINAL)["status"] == "finished"

    # 2. Stop Redis with work queued and one job running.
    inflight = submit(http, long_body())
    assert wait_status(http, inflight, ("started",))["status"] == "started"
    jobs.append(inflight)
    jobs += [submit(http, small_body()) for _ in range(2)]
    s.redis.stop()
    down_at = time.monotonic()
    latencies = {}
    for name, call in [("POST /gradients", lambda: http.post("/gradients?wait=10", json=small_body())),
                       ("GET /jobs/{id}", lambda: http.get(f"/jobs/{jobs[-1]}")),
                       ("POST /jobs/{id}/cancel", lambda: http.post(f"/jobs/{jobs[-1]}/cancel")),
                       ("GET /readyz", lambda: http.get("/readyz"))]:
        t = time.monotonic()
        r = call()
        latencies[name] = time.monotonic() - t
        assert r.status_code == 503, (name, r.text)
        assert r.json()["error"]["code"] == "queue_unavailable"
        assert r.headers.get("retry-after")
    print("answers while Redis is down:", {k: f"{v * 1000:.0f} ms" for k, v in latencies.items()})
    assert max(latencies.values()) < 5  # "within a second or two"; generous for a loaded CI box
    assert http.get("/healthz").status_code == 200
    time.sleep(max(0.0, 4 - (time.monotonic() - down_at)))
    assert all(p.poll() is None for p in s.workers[1:]), f"a worker exited while Redis was down; logs in {s.logdir}"

    s.redis.start()
    # The very first request after the restart succeeds: no pooled connection left dead answers 503.
    assert http.get(f"/jobs/{jobs[0]}").status_code == 200
    t0 = time.monotonic()
    while http.get("/readyz").status_code != 200:
        assert time.monotonic() - t0 < 60, f"the stack did not recover; logs in {s.logdir}"
        time.sleep(0.25)
    print(f"ready again {time.monotonic() - t0:.1f} s after Redis came back")

    # 3. Every job ever submitted ends; new work runs on the same (never restarted) API and worker.
    http.post(f"/jobs/{inflight}/cancel")  # the long job may have survived the outage: no need to run it out
    ends = {job_id: wait_status(http, job_id, TERMINAL, 60) for job_id in jobs}
    print("final:", {k[:8]: (v["status"], v["error"] and v["error"]["code"]) for k, v in ends.items()})
    assert all(v["status"] in TERMINAL for v in ends.values()), ends
    assert all(ends[j]["status"] == "finished" for j in jobs[-2:])
    r = http.post("/gradients?wait=30", json=small_body())
    assert r.status_code == 200, r.text
    assert all(p.poll() is None for p in s.workers[1:])

    # 4. A hung Redis (SIGSTOP: connections open, no answers), also for a request blocked waiting on a job.
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(lambda: (time.monotonic(), http.post("/gradients?wait=3", json=long_body())))
        time.sleep(1.0)
        s.redis.proc.send_signal(signal.SIGSTOP)
        try:
            t = time.monotonic()
            r = http.get(f"/jobs/{jobs[0]}")
            hung_get_s = time.monotonic() - t
            sent_at, r_wait = waiting.result(timeout=30)
            waited_s = time.monotonic() - sent_at
        finally:
            s.redis.proc.send_signal(signal.SIGCONT)
    print(f"hung Redis: GET answered {r.status_code} in {hung_get_s * 1000:.0f} ms; POST ?wait=3 answered "
          f"{r_wait.status_code} after {waited_s:.1f} s")
    assert r.status_code == 503 and hung_get_s < 5
    assert r_wait.status_code == 503 and r_wait.json()["error"]["code"] == "queue_unavailable"
    stuck = r_wait.json()["error"]["detail"]["job_id"]  # the client can still find its job
    assert waited_s < 3 + 5
    http.post(f"/jobs/{stuck}/cancel")
    assert wait_status(http, stuck, TERMINAL, 60)["status"] in TERMINAL
    assert http.post("/gradients?wait=30", json=small_body()).status_code == 200


@pytest.fixture()
def default_stack():
    s = start_stack(workers=1)  # the default heartbeat and lease
    yield s
    s.stop()


def test_a_worker_killed_mid_job_fails_it_worker_lost_within_10_s_and_an_open_wait_returns_that(default_stack):
    s = default_stack
    http = httpx.Client(base_url=s.base_url, timeout=90)
    key = {"Idempotency-Key": "kill-9-test"}
    job_id = http.post("/gradients?wait=0", json=long_body(), headers=key).json()["job_id"]
    assert wait_status(http, job_id, ("started",))["status"] == "started"
    with ThreadPoolExecutor(1) as pool:
        # The same key: this request waits on the running job (a minute), as a client's `wait` would.
        waiting = pool.submit(lambda: http.post("/gradients?wait=60", json=long_body(), headers=key))
        time.sleep(1.0)
        s.workers[0].send_signal(signal.SIGKILL)
        s.workers[0].wait()
        killed_at = time.monotonic()
        r = waiting.result(timeout=90)
        answered_s = time.monotonic() - killed_at
    print(f"open wait answered {r.status_code} {answered_s:.1f} s after SIGKILL")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "worker_lost" and r.json()["job_id"] == job_id
    assert r.json()["status"] == "failed"
    assert answered_s < 10
    job = http.get(f"/jobs/{job_id}").json()
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_gradsvc_up_restarts_a_worker_killed_with_sigkill(tmp_path):
    up, url = start_up(tmp_path)
    http = httpx.Client(base_url=url, timeout=30)
    try:
        wait_ready(http, 60, lambda: (tmp_path / "up.log").read_text())
        workers = [p for p in _children(up.pid) if " worker" in _cmdline(p)]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        while True:
            now = [p for p in _children(up.pid) if " worker" in _cmdline(p)]
            if now and now != workers:
                break
            assert time.monotonic() - t0 < 30, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
        r = http.post("/gradients?wait=60", json=small_body())
        print(f"worker restarted by gradsvc up; first job after {time.monotonic() - t0:.1f} s")
        assert r.status_code == 200, r.text
    finally:
        kids = _children(up.pid)
        up.send_signal(signal.SIGINT)
        up.wait(timeout=30)
        time.sleep(0.5)
        assert not [p for p in kids if _cmdline(p)], "gradsvc up left a process behind"
