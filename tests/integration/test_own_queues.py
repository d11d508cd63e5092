"""A worker's own queue (affinity: gradsvc/broker/affinity.py) over a live stack of two real workers whose jobs may
wait an hour in a holder's own queue (so what moves a job here is its holder's death, never its wait): the API's
gradsvc_queue_depth counts the jobs waiting in own queues (`gradsvc-own`); a holder killed with SIGKILL while a job
waits in its own queue has that job moved to the shared queue and run once by the other worker within a few
heartbeats, and its own queue's name leaves RQ's set of queues."""

from __future__ import annotations

import base64
import signal
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue

from gradsvc.broker import keys
from gradsvc.runtime.settings import Settings
from tests.integration.test_resident_models import _finished_once, body, by_ref, job_of, post, weights
from tests.support.stack import Stack, start_stack

KEY = "own-queues-owner-0123"
PREFIX = Settings().queue_prefix
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def patient() -> Stack:
    s = start_stack(workers=2, GRADSVC_API_KEYS=KEY, GRADSVC_AFFINITY_WAIT_MS="3600000",
                    GRADSVC_WORKER_HEARTBEAT_S="1")
    yield s
    s.stop()


def _own_depth(c: httpx.Client) -> float:
    families = text_string_to_metric_families(c.get("/metrics").text)
    return next(s.value for f in families for s in f.samples
                if s.name == "gradsvc_queue_depth" and s.labels["queue"] == f"{PREFIX}-own")


def _long(payload: dict, rows: int = 8192) -> dict:
    """The same model over a large batch, 50 timed passes: seconds on its holder."""
    x = torch.randn(rows, 256)
    return {**payload, "inputs": {"dtype": "float32", "shape": [rows, 256],
                                  "b64": base64.b64encode(x.numpy().tobytes()).decode()},
            "targets": [i % 10 for i in range(rows)], "options": {"numcheck": "off", "memory": False,
                                                                  "timing_repeat": 50}}


def test_a_job_in_a_killed_holders_own_queue_is_counted_then_moved_at_once_and_the_queue_forgotten(patient):
    c = httpx.Client(base_url=patient.base_url, timeout=120, headers={"Authorization": f"Bearer {KEY}"})
    with c:
        payload = body(by_ref(c, weights(40, width=512)), width=512)
        holder = job_of(patient, post(c, payload)["job_id"]).worker_name
        own = keys.own_queue_name(PREFIX, holder)
        assert _own_depth(c) == 0
        slow = c.post("/gradients?wait=0", json=_long(payload))
        assert slow.status_code == 202, slow.text
        deadline = time.monotonic() + 60
        while job_of(patient, slow.json()["job_id"]).get_status() != "started":
            assert time.monotonic() < deadline, patient.logs()
            time.sleep(0.05)
        assert job_of(patient, slow.json()["job_id"]).worker_name == holder
        quick = c.post("/gradients?wait=0", json=payload).json()["job_id"]
        assert job_of(patient, quick).origin == own  # waiting for its busy holder
        assert _own_depth(c) == 1
        proc = next(p for p in patient.workers if f"-{p.pid}-" in holder)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        done = _finished_once(patient, quick)
        assert done.get_status() == "finished" and done.worker_name != holder and done.origin == PREFIX
        assert time.monotonic() - killed < 60  # its holder's lease (3 heartbeats) and a sweep, not its hour's wait
        with patient.redis_client() as redis:
            assert own not in {q.name for q in Queue.all(connection=redis)}
            assert not redis.exists(keys.rq_queue_key(own))
        assert _own_depth(c) == 0
