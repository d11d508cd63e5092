"""One job per key, and a 202 that tells the truth, on the real stack (Redis, RQ worker, HTTP)."""

from __future__ import annotations

import copy
import time
import uuid

from redis import Redis
from rq import Worker

from gradclient import Client

from tests.support.nets import SEED_A_LAYERS
from tests.support.stack import Stack
from .test_reliability import long_body, wait_status


def small_body(**options) -> dict:
    return {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
            "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
            "options": {"numcheck": "off", **options}}


def jobs_run(stack: Stack) -> int:
    """The jobs the workers say they finished (RQ's per-worker counters in Redis). Failed jobs are left
    out: a job another test canceled is counted as failed a moment after its status says so."""
    redis = Redis.from_url(stack.redis.url)
    try:
        return sum(w.successful_job_count for w in Worker.all(connection=redis))
    finally:
        redis.close()


def test_a_repeated_idempotency_key_returns_the_same_job_and_runs_it_once(http, stack):
    key = {"Idempotency-Key": str(uuid.uuid4())}
    before = jobs_run(stack)
    first = http.post("/gradients?wait=30", json=small_body(), headers=key)
    assert first.status_code == 200, first.text
    again = [http.post(f"/gradients?wait={w}", json=small_body(), headers=key) for w in (30, 0)]
    assert [r.status_code for r in again] == [200, 200]  # the finished job's result, even with wait=0
    assert {r.json()["job_id"] for r in [first, *again]} == {first.json()["job_id"]}
    assert again[0].json()["gradients"] == first.json()["gradients"]
    other = http.post("/gradients?wait=30", json=small_body(), headers={"Idempotency-Key": str(uuid.uuid4())})
    assert other.status_code == 200 and other.json()["job_id"] != first.json()["job_id"]
    time.sleep(0.5)  # RQ counts a job after its result is stored
    assert jobs_run(stack) - before == 2  # the keyed request once, the other key once


def test_a_key_reused_for_another_body_is_a_422_naming_the_header(http):
    key = {"Idempotency-Key": str(uuid.uuid4())}
    assert http.post("/gradients?wait=30", json=small_body(), headers=key).status_code == 200
    r = http.post("/gradients?wait=30", json=small_body(memory=False), headers=key)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "idempotency_key_reused" and error["detail"]["header"] == "Idempotency-Key"
    bad = http.post("/gradients", json=small_body(), headers={"Idempotency-Key": "x" * 300})
    assert bad.status_code == 400 and bad.json()["error"]["detail"] == {"header": "Idempotency-Key"}


def test_the_202_answer_gives_the_jobs_real_status_and_progress(http):
    key = {"Idempotency-Key": str(uuid.uuid4())}
    r = http.post("/gradients?wait=0", json=long_body(), headers=key)
    assert r.status_code == 202 and r.json()["status"] in ("queued", "started")
    job_id = r.json()["job_id"]
    assert r.headers["location"] == f"/jobs/{job_id}"
    try:
        deadline = time.monotonic() + 60
        while http.get(f"/jobs/{job_id}").json()["progress"] is None:  # written at most every 0.5 s
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = http.post("/gradients?wait=0.5", json=long_body(), headers=key)
        assert r.status_code == 202 and r.json()["job_id"] == job_id
        assert r.json()["status"] == "started"
        progress = r.json()["progress"]  # what the job last wrote, as GET /jobs/{id} gives it
        assert progress["phase"] in ("forward", "backward", "numcheck") and progress["done"] <= progress["total"]
    finally:
        http.post(f"/jobs/{job_id}/cancel")
    assert wait_status(http, job_id, ("canceled", "failed", "finished"))["status"] == "canceled"


def test_the_sdk_runs_each_call_once(stack):
    before = jobs_run(stack)
    with Client(stack.base_url, timeout=60) as client:
        for _ in range(3):
            client.gradients(small_body()["model"], [[0.1] * 6, [0.2] * 6], [0, 2], numcheck="off")
    time.sleep(0.5)
    assert jobs_run(stack) - before == 3
