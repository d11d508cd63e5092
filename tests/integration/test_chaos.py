"""What survives a Redis restart: `gradsvc up`'s embedded Redis (nothing), then Redis with its append-only
file on one real stack (a private redis-server, the API over HTTP, two RQ workers): compose's setting
restarted, then a chaos run, a bounded load through the SDK while a worker, the API and Redis are killed
at seeded random moments; every call is accounted for."""

from __future__ import annotations

import os
import random
import re
import signal
import tempfile
import threading
import time
from collections import Counter

import httpx
import pytest

from ..support.stack import Stack, start_stack, start_up, wait_ready, wait_status
from .load import account, job_ids, run_load
from .test_reliability import small_body, submit

SEED = 24
CLIENTS, CALLS_PER_CLIENT = 4, 50
# Each client's calls PACE_S apart: the load lasts over 12 s however fast the machine, and its faults come at
# random moments within FAULT_WINDOW_S: each kind once, and one more.
PACE_S = 0.25
FAULT_WINDOW_S = (1.0, 8.0)
_STARTED = re.compile(r"Worker gradsvc-\S+: \S+: .*\(([0-9a-f-]{36})\)\s*$")


def test_gradsvc_up_restarts_its_embedded_redis_empty_and_the_stack_recovers_alone(tmp_path):
    up, url = start_up(tmp_path)
    log = lambda: (tmp_path / "up.log").read_text()  # noqa: E731
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            wait_ready(http, 90, log)
            r = http.post("/gradients?wait=30", json=small_body())
            assert r.status_code == 200, r.text
            finished = r.json()["job_id"]
            os.kill(int((tmp_path / ".gradsvc" / "redis.pid").read_text()), signal.SIGKILL)
            time.sleep(1.0)  # the launcher looks every 0.5 s
            wait_ready(http, 60, log)  # the embedded Redis is back (empty) and the worker registered again
            job = http.get(f"/jobs/{finished}").json()
            assert job["status"] == "failed" and job["error"]["code"] == "job_lost", job
            assert http.post("/gradients?wait=60", json=small_body()).status_code == 200
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=30)


@pytest.fixture(scope="module")
def aof_stack():
    datadir = tempfile.mkdtemp(prefix="gradsvc-aof-")
    # deploy/docker-compose.yml's Redis: `--appendonly yes` (appendfsync everysec, Redis's default).
    s = start_stack(workers=2, redis_args=("--appendonly", "yes", "--dir", datadir), GRADSVC_WORKER_HEARTBEAT_S="1",
                    GRADSVC_REDIS_TIMEOUT_S="1", GRADSVC_LOG_LEVEL="info")
    yield s
    s.stop()


def _restart_workers(s: Stack) -> None:
    for proc in s.workers:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    for index in range(2):
        s.start_worker(index)


def test_with_aof_finished_and_queued_jobs_and_idempotency_keys_survive_a_redis_restart(aof_stack):
    s = aof_stack
    with s.http_client(timeout=60) as http:
        done_key = {"Idempotency-Key": "aof-finished"}
        r = http.post("/gradients?wait=30", json=small_body(), headers=done_key)
        assert r.status_code == 200, r.text
        finished = r.json()["job_id"]
        for proc in s.workers:  # no worker: the next jobs stay queued across the restart
            proc.terminate()
            proc.wait(timeout=30)
        queued_key = {"Idempotency-Key": "aof-queued"}
        r = http.post("/gradients?wait=0", json=small_body(), headers=queued_key)
        assert r.status_code == 202, r.text
        queued = [r.json()["job_id"], submit(http, small_body()), submit(http, small_body())]

        s.redis.stop()  # SIGTERM, as `docker compose restart redis` sends: Redis writes its AOF out and exits
        s.redis.start()

        job = http.get(f"/jobs/{finished}").json()
        assert job["status"] == "finished" and job["result"]["loss"] > 0, job
        assert [http.get(f"/jobs/{j}").json()["status"] for j in queued] == ["queued"] * 3
        # The SDK's retries of both keyed POSTs: the jobs they made before the restart, nothing new.
        age = {"Idempotency-Key-Age": "5.0"}
        r = http.post("/gradients?wait=30", json=small_body(), headers={**done_key, **age})
        assert r.status_code == 200 and r.json()["job_id"] == finished, r.text
        r = http.post("/gradients?wait=0", json=small_body(), headers={**queued_key, **age})
        assert r.status_code == 202 and r.json()["job_id"] == queued[0], r.text

        _restart_workers(s)
        assert [wait_status(http, j)["status"] for j in queued] == ["finished"] * 3
    with s.redis_client() as r:
        assert sum(1 for k in r.scan_iter("rq:job:*") if r.type(k) == b"hash") == 4


def _worker_starts(s: Stack) -> Counter:
    """How many times each job was started, by the workers' own logs (RQ logs each job it dequeues): a side
    effect outside Redis, so a job run twice shows even had Redis lost the first run's records."""
    starts: Counter = Counter()
    for log in s.logdir.glob("worker-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = _STARTED.search(line)
            if m and "Job OK" not in line:  # the dequeue's line, not the end's
                starts[m.group(1)] += 1
    return starts


def _chaos(s: Stack, rng: random.Random, done: threading.Event) -> list[tuple[float, str]]:
    """Kills one of each (a worker, the API, Redis) and one more of any, at seeded random moments; each is
    brought back as its supervisor would (`gradsvc up`, compose's restart policy), the API in the
    background (it takes seconds to start): the faults, as (seconds into the load, kind)."""
    kinds = ["worker", "api", "redis", rng.choice(["worker", "api", "redis"])]
    rng.shuffle(kinds)
    moments = sorted(rng.uniform(*FAULT_WINDOW_S) for _ in kinds)
    workers = dict(enumerate(s.workers[-2:]))
    faults, t0 = [], time.monotonic()
    api_back = threading.Thread()
    for at, kind in zip(moments, kinds):
        if done.wait(max(0.0, t0 + at - time.monotonic())):
            break
        faults.append((round(time.monotonic() - t0, 1), kind))
        if kind == "worker":
            index = rng.randrange(2)
            workers[index].send_signal(signal.SIGKILL)
            workers[index].wait()
            workers[index] = s.start_worker(index)
        elif kind == "api":
            if api_back.is_alive():
                api_back.join()
            s.api.send_signal(signal.SIGKILL)
            s.api.wait()
            api_back = threading.Thread(target=s.start_api)
            api_back.start()
        else:
            s.redis.proc.send_signal(signal.SIGKILL)
            s.redis.proc.wait()
            s.redis.start()
    if api_back.is_alive():
        api_back.join()
    return faults


def test_chaos_a_worker_the_api_and_redis_killed_under_load_lose_and_repeat_no_job(aof_stack):
    s = aof_stack
    # appendfsync always: a Redis killed with SIGKILL keeps every write it acknowledged (with everysec it may
    # lose the last second, and a job popped in it would be popped, and run, again).
    s.redis.args = (*s.redis.args, "--appendfsync", "always")
    with s.redis_client() as r:
        r.config_set("appendfsync", "always")
        before = job_ids(r)
    done = threading.Event()
    outcomes: list = []
    t0 = time.monotonic()
    load = threading.Thread(target=lambda: outcomes.extend(run_load(s.base_url, CLIENTS, CALLS_PER_CLIENT, done, pace_s=PACE_S)))
    load.start()
    faults = _chaos(s, random.Random(SEED), done)
    load.join(timeout=300)
    assert done.is_set(), f"the load did not end; logs in {s.logdir}"
    elapsed = time.monotonic() - t0
    with s.redis_client() as r:
        figures = account(outcomes, r, before)
    starts = _worker_starts(s)
    twice = {j: n for j, n in starts.items() if n > 1}
    figures.update(started_by_workers=sum(1 for o in outcomes if o.job_id in starts), started_twice=len(twice),
                   faults=faults, seconds=round(elapsed, 1))
    print(f"chaos (seed {SEED}):", figures)
    assert not twice, f"jobs the workers started more than once: {twice}; logs in {s.logdir}"
    for o in outcomes:
        if o.code == "finished":
            assert starts[o.job_id] == 1, o
    assert figures["calls"] == CLIENTS * CALLS_PER_CLIENT
    assert [kind for _, kind in faults].count("redis") >= 1 and len(faults) == 4, faults
