"""What a hostile caller or a careless operator does to a real stack (a private redis-server, the API over HTTP,
real RQ workers), one test per attack: each answers a coded 4xx or 503 saying what and how to fix, and leaves
the service serving every other key."""

from __future__ import annotations

import copy
import time

import httpx
import pytest

from tests.support.nets import SEED_A_LAYERS
from tests.support.stack import Stack, start_stack

KEYS = ("attacker-key-0123456789", "bystander-key-0123456789")


def small_body(**options) -> dict:
    return {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
            "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
            "loss": "cross_entropy", "options": {"numcheck": "off", **options}}


def keyed(stack: Stack, key: str, timeout: float = 60) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, timeout=timeout, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def refusing() -> Stack:
    """A stack whose Redis the tests turn to refusing writes and back: its own, so no other test sees it."""
    s = start_stack(workers=1, GRADSVC_API_KEYS=",".join(KEYS), GRADSVC_WORKER_HEARTBEAT_S="1")
    yield s
    s.stop()


def _refused_everywhere(stack: Stack, code: str) -> None:
    with keyed(stack, KEYS[0]) as http:
        answers = {"POST /gradients": http.post("/gradients?wait=5", json=small_body()),
                   "keyed POST": http.post("/gradients?wait=5", json=small_body(), headers={"Idempotency-Key": "k1"}),
                   "PUT /tensors": http.put(f"/tensors/{'0' * 64}", content=b"x" * 8),
                   "/readyz": http.get("/readyz"),
                   "login": http.post("/ui/login", data={"key": KEYS[0], "next": "/ui/jobs"})}
    for what, r in answers.items():
        if what == "PUT /tensors" and r.status_code == 422:
            continue  # the digest is checked before Redis is asked
        assert r.status_code == 503, (what, r.status_code, r.text)
        assert r.json()["error"]["code"] == code, (what, r.text)
        assert int(r.headers["retry-after"]) > 0, what


def test_redis_at_maxmemory_answers_503_redis_oom_and_readyz_says_so_and_the_worker_waits(refusing):
    r = refusing.redis_client()
    worker = refusing.workers[0]
    try:
        r.config_set("maxmemory", 1)
        _refused_everywhere(refusing, "redis_oom")
        time.sleep(8)  # an idle worker's dequeue timeouts and heartbeats meet the refusals meanwhile
        assert worker.poll() is None, refusing.logs()
    finally:
        r.config_set("maxmemory", 0)
        r.close()
    metrics = httpx.get(refusing.base_url + "/metrics").text
    assert 'gradsvc_redis_refusals_total{code="redis_oom"}' in metrics
    with keyed(refusing, KEYS[1]) as http:
        done = http.post("/gradients?wait=60", json=small_body())
    assert done.status_code == 200, (done.text, refusing.logs())


def test_a_read_only_redis_answers_503_redis_readonly(refusing):
    from gradsvc.runtime.launcher import free_port

    r = refusing.redis_client()
    try:
        r.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a master that is not there: no sync
        _refused_everywhere(refusing, "redis_readonly")
        assert refusing.workers[0].poll() is None, refusing.logs()
    finally:
        r.execute_command("REPLICAOF", "NO", "ONE")
        r.close()
    with keyed(refusing, KEYS[1]) as http:
        done = http.post("/gradients?wait=60", json=small_body())
    assert done.status_code == 200, (done.text, refusing.logs())
