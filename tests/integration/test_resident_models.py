"""Resident models and affinity over real HTTP, Redis and two workers: a repeated step by reference is "resident"
with no byte copied and the gradients of a freshly built model bit for bit (layer spec and graph); another owner's
job never gets the model; a worker at its resident byte budget evicts and still answers (its metrics count it);
the second job of a held model goes to its holder's own queue, and when the holder is busy past the wait, or gone,
another worker runs it exactly once."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import torch
from rq.job import Job
from torch import nn

from gradclient import Client
from gradsvc.broker import blobs, keys
from gradsvc.runtime.settings import Settings

from tests.support.stack import Stack, start_stack

KEYS = ("resident-owner-a-0123", "resident-owner-b-0123")
PREFIX = Settings().queue_prefix
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def two() -> Stack:
    # Room for about two of the ~1 MB models below a worker: a third evicts.
    s = start_stack(workers=2, GRADSVC_API_KEYS=",".join(KEYS), GRADSVC_RESIDENT_MODEL_BYTES=str(3 << 20),
                    GRADSVC_AFFINITY_WAIT_MS="200", GRADSVC_WORKER_HEARTBEAT_S="1")
    yield s
    s.stop()


def http(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def layers(width: int = 1024) -> list[dict]:
    return [{"type": "Linear", "in_features": 256, "out_features": width}, {"type": "Tanh"},
            {"type": "Linear", "in_features": width, "out_features": 10}]


def weights(seed: int, width: int = 1024) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return dict(nn.Sequential(nn.Linear(256, width), nn.Tanh(), nn.Linear(width, 10)).state_dict())


def by_ref(c: httpx.Client, state: dict[str, torch.Tensor]) -> dict:
    """Every weight uploaded (PUT /tensors) and named by its ref."""
    out = {}
    for name, t in state.items():
        data = t.contiguous().numpy().tobytes()
        assert c.put(f"/tensors/{blobs.digest(data)}", content=data).status_code in (200, 201)
        out[name] = {"dtype": "float32", "shape": list(t.shape), "refs": [blobs.digest(data)]}
    return out


def body(model_weights: dict, width: int = 1024, **options) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"model": {"layers": layers(width), "dtype": "float32", "weights": model_weights},
            "inputs": torch.randn(4, 256, generator=g).tolist(), "targets": [1, 2, 3, 4],
            "options": {"numcheck": "off", "memory": False, "encoding": "list", **options}}


def post(c: httpx.Client, payload: dict) -> dict:
    r = c.post("/gradients?wait=120", json=payload)
    assert r.status_code == 200, r.text
    return r.json()


def job_of(stack: Stack, job_id: str) -> Job:
    with stack.redis_client() as redis:
        return Job.fetch(job_id, connection=redis)


def _autograd(state: dict[str, torch.Tensor], payload: dict, width: int = 1024) -> dict[str, torch.Tensor]:
    model = nn.Sequential(nn.Linear(256, width), nn.Tanh(), nn.Linear(width, 10))
    model.load_state_dict(state)
    x, y = torch.tensor(payload["inputs"]), torch.tensor(payload["targets"])
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_a_repeated_step_by_reference_is_resident_and_another_owner_never_sees_it(two):
    state = weights(0)
    with http(two, KEYS[0]) as a, http(two, KEYS[1]) as b:
        payload = body(by_ref(a, state))
        first, again = post(a, payload), post(a, payload)
        assert (first["prepared"], first["copied_bytes"]) == ("built", sum(t.numel() * 4 for t in state.values()))
        assert (again["prepared"], again["copied_bytes"]) == ("resident", 0)
        assert job_of(two, again["job_id"]).worker_name == job_of(two, first["job_id"]).worker_name
        assert again["gradients"] == first["gradients"] and again["loss"] == first["loss"]  # bit for bit
        other = post(b, body(by_ref(b, state)))  # the same bytes, another owner: its own model, built
        assert other["prepared"] == "built" and other["gradients"] == first["gradients"]
    for name, g in _autograd(state, payload).items():
        got = torch.tensor(again["gradients"][name]["data"])
        assert torch.allclose(got, g, rtol=1e-5, atol=1e-6), name


def test_a_repeated_graph_step_through_the_sdk_is_resident(two):
    class Net(nn.Module):  # not a plain Sequential: the SDK sends it as a graph
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(256, 512), nn.Linear(512, 10)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)) * 2)

    torch.manual_seed(3)
    net = Net()
    x, y = torch.randn(4, 256), torch.tensor([0, 1, 2, 3])
    with Client(two.base_url, api_key=KEYS[0], timeout=120) as client:
        first = client.gradients(net, x, y, numcheck="off", memory=False)
        again = client.gradients(net, x, y, numcheck="off", memory=False)
    assert first.prepared == "built" and (again.prepared, again.copied_bytes) == ("resident", 0)
    nn.functional.cross_entropy(net(x), y).backward()
    for name, p in net.named_parameters():
        assert torch.equal(again.gradients[name], first.gradients[name]), name
        assert torch.allclose(again.gradients[name], p.grad, rtol=1e-5, atol=1e-6), name


def _metric(stack: Stack, name: str) -> float:
    """The sum of a metric over the stack's workers (each serves its own port)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for i in range(len(stack.workers)):
        text = httpx.get(f"http://127.0.0.1:{stack.metrics_port + i}/metrics", timeout=10).text
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)
    return total


def test_a_worker_at_its_resident_budget_evicts_and_still_answers(two):
    before = _metric(two, "gradsvc_resident_model_evictions_total")
    with http(two, KEYS[0]) as a:
        for width in range(1000, 1006):  # six models of ~1 MB each into 3 MB per worker
            state = weights(width, width)
            payload = body(by_ref(a, state), width)
            got = post(a, payload)
            for name, g in _autograd(state, payload, width).items():
                assert torch.allclose(torch.tensor(got["gradients"][name]["data"]), g, rtol=1e-5, atol=1e-6), name
    assert _metric(two, "gradsvc_resident_model_evictions_total") > before
    assert _metric(two, "gradsvc_resident_model_hits_total") >= 1 and _metric(two, "gradsvc_resident_model_bytes") > 0


def _finished_once(stack: Stack, job_id: str) -> Job:
    with stack.redis_client() as redis:
        deadline = time.monotonic() + 120
        while redis.hget(Job.key_for(job_id), "status") not in (b"finished", b"failed"):
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.1)
        assert redis.xlen(keys.rq_results_stream(job_id)) == 1  # one outcome: it ran once
        return Job.fetch(job_id, connection=redis)


def test_the_next_job_of_a_held_model_goes_to_its_holder_and_moves_when_the_holder_is_busy(two):
    with http(two, KEYS[1]) as b:
        payload = body(by_ref(b, weights(20, width=512)), width=512)
        holder = job_of(two, post(b, payload)["job_id"]).worker_name
        second = post(b, payload)
        assert second["prepared"] == "resident"
        job = job_of(two, second["job_id"])
        assert job.origin == keys.own_queue_name(PREFIX, holder) and job.worker_name == holder
        # The holder busy with a long job of the same model (routed to it), the next one moves to the shared queue.
        import base64

        x = torch.randn(4096, 256)  # 50 timed passes over a large batch: seconds on the holder
        long = {**payload, "inputs": {"dtype": "float32", "shape": [4096, 256],
                                      "b64": base64.b64encode(x.numpy().tobytes()).decode()},
                "targets": [i % 10 for i in range(4096)],
                "options": {"numcheck": "off", "memory": False, "timing_repeat": 50}}
        slow = b.post("/gradients?wait=0", json=long)
        assert slow.status_code == 202, slow.text
        deadline = time.monotonic() + 60
        while job_of(two, slow.json()["job_id"]).get_status() != "started":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        quick = b.post("/gradients?wait=0", json=payload).json()["job_id"]
        moved = _finished_once(two, quick)
        assert moved.get_status() == "finished" and moved.worker_name != holder and moved.origin == PREFIX
        assert _finished_once(two, slow.json()["job_id"]).worker_name == holder
        with two.redis_client() as redis:
            assert redis.llen(keys.rq_queue_key(keys.own_queue_name(PREFIX, holder))) == 0


def test_a_job_routed_to_a_holder_that_died_runs_once_on_another_worker(two):
    with http(two, KEYS[1]) as b:
        payload = body(by_ref(b, weights(30, width=384)), width=384)
        holder = job_of(two, post(b, payload)["job_id"]).worker_name
        proc = next(p for p in two.workers if f"-{p.pid}-" in holder)
        proc.kill()  # its RQ key stays until its lease lapses: the API still routes to its own queue meanwhile
        proc.wait()
        job_id = b.post("/gradients?wait=0", json=payload).json()["job_id"]
        done = _finished_once(two, job_id)
        assert done.get_status() == "finished" and done.worker_name != holder
        assert msgspec.json.decode(b.get(f"/jobs/{job_id}").content)["result"]["prepared"] == "built"
