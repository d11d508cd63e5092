"""Training sessions under a hostile user and a careless operator, on the live stack (three real workers, Redis,
HTTP): integers past 64 bits and learning rates beyond the session's dtype are 422s before the queue; a step
takes its tensors by reference as POST /gradients does; a complex128 parameter checkpoints; a DELETE while a
step runs stays a delete; an answer too large is refused before the step is applied; a remembered idempotency
key replays for as long as it is remembered, and one whose answer Redis lost is a 410, not a second application;
outputs found too large after a step are left out and named; a weights download is not kept in Redis; an expired
session leaves its worker's memory; two steps sent at once after the holder died are both applied, one after the
other; a session Redis lost reads 410 session_lost. Each ends on the weights of a local torch.optim loop over the
steps that were acknowledged."""

from __future__ import annotations

import copy
import hashlib
import os
import signal
import threading
import time

import httpx
import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradclient.tensors import to_wire
from tests.support.stack import client_fixtures, module_stack, sdk_fixture, wait_started

pytestmark = pytest.mark.timeout(600)
KEY = "faults-key"
TTL_S = 4  # short_stack's sessions unused this long expire (so the sweep and the answers' lifetime can be watched)
MAX_RESULT = 100_000  # GRADSVC_MAX_RESULT_BYTES: a 16k-parameter float64 model's weights are over it
faults_stack = module_stack(workers=3, GRADSVC_API_KEYS=KEY, GRADSVC_WORKER_HEARTBEAT_S="1",
                            GRADSVC_MAX_RESULT_BYTES=str(MAX_RESULT))
short_stack = module_stack(workers=1, GRADSVC_API_KEYS=KEY, GRADSVC_WORKER_HEARTBEAT_S="1",
                           GRADSVC_SESSION_IDLE_TTL_S=str(TTL_S))
LAYERS = [{"type": "Linear", "in_features": 4, "out_features": 8}, {"type": "Tanh"},
          {"type": "Linear", "in_features": 8, "out_features": 3}]


def net(width: int = 8, dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3)).to(dtype)


def batches(n: int, dtype=torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=g, dtype=dtype), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def body(x: torch.Tensor, y: torch.Tensor, **extra) -> dict:
    return {"inputs": msgspec.to_builtins(to_wire(x, "json")), "targets": msgspec.to_builtins(to_wire(y, "json")),
            "loss": "cross_entropy", **extra}


def local(model: nn.Module, data, lr: float = 0.1) -> nn.Module:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def pulled(s, like: nn.Module) -> nn.Module:
    got = copy.deepcopy(like)
    s.pull(got)
    return got


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=name)


http, _redis = client_fixtures("faults_stack")
short_http, _short_redis = client_fixtures("short_stack")
client, short_client = sdk_fixture("faults_stack"), sdk_fixture("short_stack")


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_integers_past_64_bits_and_an_lr_beyond_the_dtype_are_422s_naming_the_field(http):
    def create(**changes) -> httpx.Response:
        spec = {"model": {"layers": LAYERS, "dtype": "float32", "seed": 0}, "optimizer": {"type": "sgd", "lr": 0.1}}
        for path, value in changes.items():
            *parents, last = path.split("__")
            node = spec
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        return http.post("/sessions", json=spec)

    for where, value in (("model.seed", 2 ** 64), ("model.seed", -2 ** 63 - 1),
                         ("options.checkpoint_every", 2 ** 70), ("optimizer.lr", 1e39), ("optimizer.eps", 1e39)):
        e = error(create(**{where.replace(".", "__"): value}), 422)
        assert (e["code"], e["detail"]["option"]) == ("bad_option", where), e
    r = create()
    assert r.status_code == 201, r.text
    path = f"/sessions/{r.json()['session_id']}"
    x, y = batches(1, torch.float32)[0]
    e = error(http.post(f"{path}/step", json=body(x, y, lr=1e39)), 422)
    assert e["detail"]["option"] == "lr" and "float32" in e["message"]
    e = error(http.post(f"{path}/optim_step", json={"lr": 1e39}), 422)
    assert e["detail"]["option"] == "lr"
    assert http.post(f"{path}/step", json=body(x, y)).json()["step"] == 1  # nothing was applied before
    assert http.post(f"{path}/step", json=body(x, y, lr=1e30)).status_code == 200  # finite in float32: taken
    http.delete(path)


def _put(http: httpx.Client, t: torch.Tensor) -> dict:
    data = t.contiguous().numpy().tobytes()
    ref = hashlib.sha256(data).hexdigest()
    r = http.put(f"/tensors/{ref}", content=data, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "refs": [ref]}


def test_a_step_takes_its_tensors_by_reference_and_an_unknown_ref_is_a_422(faults_stack, http, client):
    model, data = net(), batches(3)
    with client.session(model, "sgd", lr=0.1) as s:
        s.step(*data[0])
        for x, y in data[1:]:
            r = http.post(f"/sessions/{s.session_id}/step", json={"inputs": [_put(http, x)],
                                                                   "targets": _put(http, y), "loss": "cross_entropy"})
            assert r.status_code == 200, r.text
        unknown = {"dtype": "float64", "shape": [16, 4], "refs": ["0" * 64]}
        e = error(http.post(f"/sessions/{s.session_id}/step", json={"inputs": [unknown], "targets": _put(http, y),
                                                                    "loss": "cross_entropy"}), 422)
        assert e["code"] == "tensor_not_found"
        assert s.info().step == 3
        assert_same(pulled(s, model), local(model, data))


class Phase(nn.Module):
    """A complex128 parameter (a phase mask), trained through a real loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.out = nn.Linear(3, 3, dtype=torch.float64)
        self.mask = nn.Parameter(torch.randn(4, 3, dtype=torch.complex128))

    def forward(self, x):
        return self.out((torch.complex(x, torch.zeros_like(x)) @ self.mask).abs())


def test_a_complex128_parameter_checkpoints_and_trains_as_locally(client):
    """It was a 500 at create: safetensors has no name for complex128 (its checkpoint's round trip back to complex is
    tests/gradsvc/engine/test_session.py's)."""
    model, data = Phase(), batches(3)
    with client.session(model, "sgd", lr=0.1, checkpoint_every=1) as s:
        for x, y in data:
            s.step(x, y)
        assert s.info().checkpoint_step == 3
        got = pulled(s, model)
    assert_same(got, local(model, data))


def test_a_delete_while_a_step_runs_stays_a_delete(faults_stack, http, client):
    model, (x, y) = net(256), batches(1)[0]
    s = client.session(model, "sgd", lr=0.1)
    s.step(x, y)
    sid = s.session_id
    slow = body(x, y, options={"numcheck": "exact"})  # thousands of passes: the DELETE lands while it runs
    accepted = http.post(f"/sessions/{sid}/step?wait=0", json=slow)
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["job_id"]
    with faults_stack.redis_client() as redis:
        assert wait_started(redis, [job_id], 1) == [job_id]
        assert http.delete(f"/sessions/{sid}").status_code == 200
        deadline = time.monotonic() + 120
        while http.get(f"/jobs/{job_id}").json()["status"] not in ("finished", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        job = http.get(f"/jobs/{job_id}").json()
        assert job["status"] == "failed" and job["error"]["code"] == "not_found", job
        assert "deleted" in job["error"]["message"]
        assert list(redis.scan_iter(match=f"*{sid}*")) == []  # no record, checkpoint or answers came back
    assert error(http.get(f"/sessions/{sid}"), 404)["code"] == "not_found"
    assert error(http.post(f"/sessions/{sid}/step", json=body(x, y)), 404)["code"] == "not_found"


def test_an_answer_too_large_is_refused_before_the_step_is_applied(http, client):
    model, data = net(4096), batches(3)  # 36k float64 parameters: 290 kB of weights, over MAX_RESULT
    with client.session(model, "sgd", lr=0.1) as s:
        s.step(*data[0])
        path = f"/sessions/{s.session_id}/step"
        for _ in range(2):  # the same key again: refused again, never applied
            e = error(http.post(path, json=body(*data[1], **{"return": ["weights"]}),
                                headers={"Idempotency-Key": "too-big"}), 413)
            assert e["code"] == "result_too_large" and e["detail"]["applied"] is False
            assert "not applied" in e["message"] and "GET /sessions/{id}/weights" in e["message"]
        assert s.info().step == 1
        for x, y in data[1:]:
            assert http.post(path, json=body(x, y), headers={"Idempotency-Key": f"k{s.info().step}"}).status_code == 200
        assert s.info().step == 3
        assert_same(pulled(s, model), local(model, data))


def test_a_remembered_key_replays_for_as_long_as_the_session_lives(short_http, short_client):
    """The answer under a key used to expire one TTL after it was written while the session, kept alive by
    later steps, still remembered the key: a retry then was applied again."""
    model, data = net(), batches(5)
    with short_client.session(model, "sgd", lr=0.1) as s:
        s.step(*data[0])
        path = f"/sessions/{s.session_id}/step"
        first = short_http.post(path, json=body(*data[1]), headers={"Idempotency-Key": "early"}).json()
        for i, (x, y) in enumerate(data[2:]):  # past the TTL in all, the session never idle that long
            time.sleep(TTL_S / 2)
            r = short_http.post(path, json=body(x, y), headers={"Idempotency-Key": f"later-{i}"})
            assert r.status_code == 200, r.text
        again = short_http.post(path, json=body(*data[1]), headers={"Idempotency-Key": "early"}).json()
        assert (again["replayed"], again["step"], again["loss"]) == (True, first["step"], first["loss"])
        assert s.info().step == 5
        assert_same(pulled(s, model), local(model, data))


def test_weights_downloads_are_not_kept_in_redis(faults_stack, http, client):
    model, (x, y) = net(1024), batches(1)[0]
    with client.session(model, "sgd", lr=0.1) as s, faults_stack.redis_client() as redis:
        s.step(x, y)
        sid = s.session_id
        for accept in ("application/octet-stream", "application/msgpack", "application/json") * 4:
            assert http.get(f"/sessions/{sid}/weights", headers={"Accept": accept}).status_code == 200
        answers = [k for k in redis.scan_iter(match=f"*tsession:{sid}:answer:*")]
        assert answers == []


def _held(stack, worker: str) -> float:
    port = stack.metrics_port + int(worker.split("-")[-1])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("gradsvc_sessions_held "))


def test_an_expired_session_leaves_its_workers_memory(short_stack, short_client):
    model, (x, y) = net(), batches(1)[0]
    s = short_client.session(model, "sgd", lr=0.1)
    s.step(x, y)
    worker = s.info().worker
    assert _held(short_stack, worker) >= 1
    deadline = time.monotonic() + 4 * TTL_S
    while _held(short_stack, worker) > 0:  # no other job comes to it: the idle worker's sweep drops it
        assert time.monotonic() < deadline, "the expired session stayed on its worker"
        time.sleep(0.5)


def test_two_steps_sent_at_once_after_the_holder_died_are_both_applied_one_after_the_other(faults_stack, http,
                                                                                          client):
    model, data = net(), batches(3)
    with client.session(model, "sgd", lr=0.1, checkpoint_every=1) as s:
        s.step(*data[0])
        holder = s.info().worker
        victim = next(p for p in faults_stack.workers if p.pid == int(holder.split("-")[-2]))
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        answers: dict[int, dict] = {}

        def send(i: int) -> None:
            r = http.post(f"/sessions/{s.session_id}/step", json=body(*data[i]), headers={"Idempotency-Key": f"c{i}"})
            answers[i] = r.json() if r.status_code == 200 else {"error": r.text}

        threads = [threading.Thread(target=send, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(a.get("step") for a in answers.values()) == [2, 3], answers
        order = sorted((1, 2), key=lambda i: answers[i]["step"])
        assert s.info().step == 3
        got = pulled(s, model)
    faults_stack.start_worker()
    faults_stack.wait_ready(3)
    assert_same(got, local(model, [data[0], *(data[i] for i in order)]))


class Graphed(nn.Module):
    """net() as a module of its own: sent as a graph (options.outputs returns a graph's outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = net()

    def forward(self, x):
        return self.body(x)


def test_outputs_found_too_large_after_the_step_are_left_out_and_named_and_the_step_counts(client):
    model, g = Graphed(), torch.Generator().manual_seed(2)
    x, y = torch.randn(6000, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6000,), generator=g)
    with client.session(model, "sgd", lr=0.1) as s:
        out = s.step(x, y, returns=["outputs"], outputs=True)  # 144 kB of logits, over MAX_RESULT
        assert out.raw.omitted == ["outputs"] and out.raw.outputs is None and out.step == 1
        assert_same(pulled(s, model), local(model, [(x, y)]))


def test_a_remembered_key_whose_answer_redis_lost_is_a_410_not_a_second_application(faults_stack, http, client):
    model, data = net(), batches(2)
    with client.session(model, "sgd", lr=0.1) as s, faults_stack.redis_client() as redis:
        s.step(*data[0])
        path = f"/sessions/{s.session_id}/step"
        assert http.post(path, json=body(*data[1]), headers={"Idempotency-Key": "kept"}).status_code == 200
        redis.delete(f"gradsvc:tsession:{s.session_id}:answers")  # as a Redis that lost it
        e = error(http.post(path, json=body(*data[1]), headers={"Idempotency-Key": "kept"}), 410)
        assert e["code"] == "answer_lost" and e["detail"]["step"] == 2 and "not applied again" in e["message"]
        assert s.info().step == 2


def test_retries_a_kill_and_concurrent_steps_end_on_the_local_loop_over_the_acknowledged_steps(faults_stack, http,
                                                                                                 client):
    """Two clients step one session at once, each retrying every call under its key (and sending some twice on
    purpose); the holder is killed with SIGKILL mid-run. Every batch is acknowledged exactly once, at one step
    each, and the weights are the local loop over the batches in the order of those steps."""
    model, data = net(), batches(12)
    s = client.session(model, "sgd", lr=0.1, checkpoint_every=1)
    s.step(*data[0])
    path, steps, killed = f"/sessions/{s.session_id}/step", {}, threading.Event()

    def send(i: int) -> dict:
        for _ in range(60):  # a killed worker's job (503 worker_lost), a conflict, a call still running (202):
            r = http.post(path, json=body(*data[i]), headers={"Idempotency-Key": f"mix-{i}"})  # sent again
            if r.status_code == 200:
                return r.json()
            assert r.status_code in (202, 409, 503), r.text
            time.sleep(0.2)
        raise AssertionError(f"batch {i} never acknowledged")

    def drive(mine: list[int]) -> None:
        for n, i in enumerate(mine):
            first = send(i)
            if n % 2:  # a retry after the answer: the same step, replayed
                again = send(i)
                assert (again["replayed"], again["step"]) == (True, first["step"])
            steps[i] = first["step"]
            if n == 2 and not killed.is_set():
                killed.set()
                holder = http.get(f"/sessions/{s.session_id}").json()["worker"]
                victim = next(p for p in faults_stack.workers if p.pid == int(holder.split("-")[-2]))
                os.kill(victim.pid, signal.SIGKILL)

    failures: list[BaseException] = []

    def guarded(mine: list[int]) -> None:
        try:
            drive(mine)
        except BaseException as exc:  # a thread's failure is the test's
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(list(range(k, 12, 2)),)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert sorted(steps.values()) == list(range(2, 13)) and s.info().step == 12, steps
    got = pulled(s, model)
    s.delete()
    faults_stack.start_worker()
    faults_stack.wait_ready(3)
    order = sorted(steps, key=steps.get)
    assert_same(got, local(model, [data[0], *(data[i] for i in order)]))


def test_a_session_redis_lost_in_a_restart_reads_410_session_lost(faults_stack, http, client):
    """Last in the module: Redis emptied under the stack, as a restart without its data."""
    model, (x, y) = net(), batches(1)[0]
    s = client.session(model, "sgd", lr=0.1)
    s.step(x, y)
    with faults_stack.redis_client() as redis:
        redis.flushall()
    for r in (http.get(f"/sessions/{s.session_id}"), http.post(f"/sessions/{s.session_id}/step", json=body(x, y))):
        e = error(r, 410)
        assert e["code"] == "session_lost" and "Redis lost" in e["message"]
    assert error(http.get(f"/sessions/{'0' * 32}"), 404)["code"] == "not_found"  # never existed: still a 404
