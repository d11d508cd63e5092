"""Redis restarted empty: the running worker registers again within seconds, /readyz and
device routing recover by themselves, jobs whose records vanished read as `job_lost` (not 404 as if they
never existed), and a retry under an Idempotency-Key that vanished is refused rather than run twice."""

from __future__ import annotations

import time

import httpx
import pytest
from redis import Redis
from rq.job import Job

from tests.support.stack import start_stack, wait_ready, wait_status
from .test_hard_deadline import wedging_body
from .test_reliability import small_body, submit


@pytest.fixture()
def stack():
    s = start_stack(workers=1, GRADSVC_WORKER_HEARTBEAT_S="2", GRADSVC_REDIS_TIMEOUT_S="1")
    yield s
    s.stop()


# Down past a heartbeat in make test-all: the blip's path (lost jobs, a re-registered worker) is the same, and
# test_chaos.py restarts Redis empty for longer under load.
@pytest.mark.parametrize("down_s", [pytest.param(0.0, id="blip"),
                                    pytest.param(3.0, id="past-a-heartbeat", marks=pytest.mark.slow)])
def test_redis_restarted_empty_reports_vanished_jobs_lost_and_the_stack_recovers_alone(stack, down_s):
    http = httpx.Client(base_url=stack.base_url, timeout=90)
    running = submit(http, wedging_body(40_000))  # one op of ~10 s, across the restart
    assert wait_status(http, running, ("started",))["status"] == "started"
    # (sizes: ~7 s of one op here, so it is still running when Redis comes back)
    queued = submit(http, small_body())
    key = {"Idempotency-Key": "before-the-restart"}
    r = http.post("/gradients?wait=0", json=small_body(), headers=key)
    assert r.status_code == 202, r.text
    keyed = r.json()["job_id"]

    stack.redis.stop()
    time.sleep(down_s)  # 3 s: the worker's beat (every 2 s) finds Redis gone and its running job's lease failed
    stack.redis.start()  # same port, no data
    back = wait_ready(http, 15, lambda: f"/readyz did not recover; logs in {stack.logdir}")
    print(f"/readyz 200 again {back:.1f} s after Redis came back empty")

    for job_id in (queued, keyed):
        r = http.get(f"/jobs/{job_id}")
        assert r.status_code == 200, (job_id, r.text)
        assert r.json()["status"] == "failed" and r.json()["error"]["code"] == "job_lost", r.json()
    # The SDK's retry of the keyed POST (it says how long ago it first sent the key): not run a second time.
    r = http.post("/gradients?wait=0", json=small_body(), headers={**key, "Idempotency-Key-Age": "3.0"})
    assert r.status_code == 410 and r.json()["error"]["code"] == "job_lost", r.text
    assert http.get(f"/jobs/{'0' * 8}-0000-4000-8000-000000000000").status_code == 404  # never issued

    # New work runs, on the shared queue and on the worker's own device queue (its registration is back).
    assert http.post("/gradients?wait=60", json=small_body()).status_code == 200
    r = http.post("/gradients?wait=60", json=small_body(device="cpu"))
    assert r.status_code == 200, r.text
    # The job that ran across the restart: lost while its record is gone. After a blip its worker's final
    # save writes the whole record back (owner included), so once it ended it reads as it ended, once. Once
    # its lease failed, its worker finds the record gone and drops the outcome; the meta its progress wrote
    # again (owner included, no status) still reads as lost, not as another key's job (404), for good.
    job = wait_status(http, running, ("finished", "failed"), 30)
    print("the job that ran across the restart:", job.get("status"), job.get("error"))
    if down_s:
        assert job.get("status") == "failed" and job["error"]["code"] == "job_lost", job
        # ... and that meta does not stay in Redis forever (-2: none written, the job ended while Redis was down)
        ttl = Redis.from_url(stack.redis.url).ttl(Job.key_for(running))
        assert ttl > 0 or ttl == -2, ttl
    else:
        assert job.get("status") == "finished" or job.get("error", {}).get("code") == "job_lost", job
