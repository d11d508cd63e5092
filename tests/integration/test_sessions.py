"""Training sessions through the SDK, the API, Redis and two real workers: N session steps end on the weights of N
local torch.optim steps (a BatchNorm MLP in float64, a graph model in float32); a worker killed with SIGKILL
mid-run: the session comes back from its checkpoint on the other worker and, the lost steps sent again, ends on
the same weights; a retried step is answered again, never applied twice; the count and byte limits; another
key's session is a 404."""

from __future__ import annotations

import copy
import os
import signal

import httpx
import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradclient import Client
from gradclient.errors import NotFoundError, SessionResumedError, TooManySessionsError
from gradclient.tensors import to_wire
from tests.support.stack import module_stack

pytestmark = pytest.mark.timeout(600)
KEYS = ("session-key-alice", "session-key-bob")
sessions_stack = module_stack(workers=2, GRADSVC_API_KEYS=",".join(KEYS), GRADSVC_WORKER_HEARTBEAT_S="1",
                              GRADSVC_SESSION_MAX_PER_OWNER="3", GRADSVC_TENSOR_BUDGET_BYTES=str(4 << 20))


def client_for(stack, key: str = KEYS[0]) -> Client:
    return Client(stack.base_url, api_key=key, timeout=120)


def bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()


def batches(n: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=g, dtype=dtype), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def local_training(model: nn.Module, data, make_opt, clip: float | None = None) -> nn.Module:
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model


def assert_same(a: nn.Module, b: nn.Module, rtol: float, atol: float) -> None:
    theirs = b.state_dict()
    for name, value in a.state_dict().items():
        torch.testing.assert_close(value, theirs[name], rtol=rtol, atol=atol, msg=name)


def test_session_steps_through_the_sdk_equal_local_adamw_steps_with_clipping(sessions_stack):
    net, data = bn_net(), batches(5)
    want = local_training(net, data, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05), clip=0.5)
    with client_for(sessions_stack) as client, client.session(net, "adamw", lr=1e-2, weight_decay=0.05,
                                                              clip=0.5) as s:
        outs = [s.step(x, y) for x, y in data]
        assert [o.step for o in outs] == [1, 2, 3, 4, 5]
        assert all(o.grad_norm > 0 for o in outs)
        got = copy.deepcopy(net)
        s.pull(got)
    assert_same(got, want, rtol=1e-12, atol=1e-12)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens):
        return self.head(torch.relu(self.norm(self.emb(tokens))).mean(dim=1))


def test_a_graph_model_session_with_gradient_accumulation_equals_local_steps_in_float32(sessions_stack):
    torch.manual_seed(1)
    net = TinyLM()
    g = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, 13, (4, 6), generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(4)]
    want = copy.deepcopy(net)
    opt = torch.optim.SGD(want.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(data):
        F.cross_entropy(want(x), y).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    with client_for(sessions_stack) as client, client.session(net, "sgd", lr=0.1, momentum=0.9) as s:
        for i, (x, y) in enumerate(data):
            s.forward_backward(x, y)
            if i % 2:
                s.optim_step()
        got = copy.deepcopy(net)
        s.pull(got)
        assert s.info().step == 2
    assert_same(got, want, rtol=1e-6, atol=1e-7)


def worker_pid(name: str) -> int:
    """gradsvc-<device>-<host>-<pid>-<index>: the pid in a worker's name (workers/main.py)."""
    return int(name.split("-")[-2])


def test_a_killed_worker_session_resumes_from_its_checkpoint_and_the_replayed_steps_end_on_the_same_weights(
        sessions_stack):
    net, data = bn_net(), batches(6)
    want = local_training(net, data, lambda p: torch.optim.Adam(p, lr=1e-2))
    with client_for(sessions_stack) as client, client.session(net, "adam", lr=1e-2, checkpoint_every=2) as s:
        for x, y in data[:3]:
            s.step(x, y)  # checkpoints after steps 0 (creation) and 2
        holder = s.info().worker
        victim = next(p for p in sessions_stack.workers if p.pid == worker_pid(holder))
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        i, resumed = 3, None
        while i < len(data):
            try:
                s.step(*data[i])
                i += 1
            except SessionResumedError as exc:
                resumed = exc.detail["step"]
                i = resumed  # the steps after the checkpoint were lost: send their batches again
        assert resumed == 2
        info = s.info()
        assert info.worker != holder and info.step == 6
        got = copy.deepcopy(net)
        s.pull(got)
    sessions_stack.start_worker()
    sessions_stack.wait_ready(2)
    assert_same(got, want, rtol=1e-12, atol=1e-12)


def test_a_gracefully_stopped_worker_checkpoints_its_sessions_and_none_of_their_steps_is_lost(sessions_stack):
    net, data = bn_net(), batches(4)
    want = local_training(net, data, lambda p: torch.optim.AdamW(p, lr=1e-2))
    with client_for(sessions_stack) as client, client.session(net, "adamw", lr=1e-2, checkpoint_every=100) as s:
        for x, y in data[:2]:
            s.step(x, y)  # no checkpoint since creation: only the stop's can save these two steps
        holder = s.info().worker
        stopping = next(p for p in sessions_stack.workers if p.pid == worker_pid(holder))
        stopping.send_signal(signal.SIGTERM)
        stopping.wait(timeout=120)  # a warm shutdown: the job in hand first (at most 5 s past the signal)
        answers = [s.step(x, y) for x, y in data[2:]]  # no SessionResumedError: nothing was lost
        assert answers[0].resumed_from == 2 and [a.step for a in answers] == [3, 4]
        got = copy.deepcopy(net)
        s.pull(got)
    sessions_stack.start_worker()
    sessions_stack.wait_ready(2)
    assert_same(got, want, rtol=1e-12, atol=1e-12)


def test_a_retried_step_under_its_idempotency_key_is_answered_again_and_applied_once(sessions_stack):
    net, data = bn_net(), batches(2)
    with client_for(sessions_stack) as client, client.session(net, "sgd", lr=0.1) as s:
        s.step(*data[0])
        path = f"/sessions/{s.session_id}/step"
        body = {"inputs": msgspec.to_builtins(to_wire(data[1][0], "json")),
                "targets": msgspec.to_builtins(to_wire(data[1][1], "json")), "loss": "cross_entropy"}
        with sessions_stack.http_client() as http:
            first = http.post(path, json=body, headers={"Idempotency-Key": "step-two"}).json()
            again = http.post(path, json=body, headers={"Idempotency-Key": "step-two"}).json()
        assert (first["step"], first["replayed"]) == (2, False)
        assert (again["step"], again["replayed"], again["loss"]) == (2, True, first["loss"])
        assert s.info().step == 2
        got = copy.deepcopy(net)
        s.pull(got)
    assert_same(got, local_training(net, data, lambda p: torch.optim.SGD(p, lr=0.1)), rtol=1e-12, atol=1e-12)


def test_a_retried_create_under_its_idempotency_key_answers_the_same_session(sessions_stack):
    body = {"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 1}]},
            "optimizer": {"type": "sgd"}}
    with sessions_stack.http_client() as http:
        first = http.post("/sessions", json=body, headers={"Idempotency-Key": "create-once"})
        again = http.post("/sessions", json=body, headers={"Idempotency-Key": "create-once"})
        assert first.status_code == again.status_code == 201
        assert again.json() == first.json()
        http.delete(f"/sessions/{first.json()['session_id']}")


def test_count_and_byte_limits_answer_429_saying_what_to_do(sessions_stack):
    with client_for(sessions_stack, KEYS[1]) as client:
        big = nn.Linear(512, 1024)  # 2 MiB of float32 weights, Adam's two moments and a gradient: over 4 MiB
        with pytest.raises(TooManySessionsError, match="GRADSVC_TENSOR_BUDGET_BYTES"):
            client.session(big, "adam").step(torch.randn(2, 512), torch.randn(2, 1024), loss="mse")
        held = [client.session(bn_net(), "sgd", lr=0.1) for _ in range(3)]
        x, y = batches(1)[0]
        for s in held:
            s.step(x, y)
        with pytest.raises(TooManySessionsError, match="GRADSVC_SESSION_MAX_PER_OWNER=3"):
            client.session(bn_net(), "sgd").step(x, y)
        for s in held:
            s.delete()
        with client.session(bn_net(), "sgd", lr=0.1) as s:  # deleted sessions leave room
            assert s.step(x, y).step == 1


def test_another_keys_session_is_a_404(sessions_stack):
    x, y = batches(1)[0]
    with client_for(sessions_stack, KEYS[0]) as alice, alice.session(bn_net(), "sgd", lr=0.1) as s:
        s.step(x, y)
        sid = s.session_id
        with httpx.Client(base_url=sessions_stack.base_url, headers={"Authorization": f"Bearer {KEYS[1]}"}) as bob:
            for method, path in (("GET", ""), ("GET", "/weights"), ("DELETE", ""), ("POST", "/optim_step")):
                r = bob.request(method, f"/sessions/{s.session_id}{path}", json={} if method == "POST" else None)
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path, r.text)
        assert s.info().step == 1  # bob's DELETE deleted nothing
    with client_for(sessions_stack) as client, pytest.raises(NotFoundError):
        client._drive(client._getting(f"/sessions/{sid}", dict))  # deleted with its `with` block


def test_the_session_page_shows_its_step_bytes_device_and_the_loss_curve_of_its_run(sessions_stack):
    net, data = bn_net(), batches(3)
    with client_for(sessions_stack) as client, client.session(net, "sgd", lr=0.1, run="page-run<&>") as s:
        for x, y in data:
            s.step(x, y)
        with httpx.Client(base_url=sessions_stack.base_url, headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
            page = http.get(f"/ui/sessions/{s.session_id}").text
            other = httpx.get(f"{sessions_stack.base_url}/ui/sessions/{s.session_id}",
                              headers={"Authorization": f"Bearer {KEYS[1]}"})
        info = s.info()
    assert f'<td class="num" id="session-step">3</td>' in page
    assert f'id="session-bytes">{info.state_bytes}<' in page and 'id="session-device">cpu<' in page
    assert 'id="loss-plot"' in page and "page-run&lt;&amp;&gt;" in page and "page-run<&>" not in page
    assert other.status_code == 404


def test_an_async_session_steps_as_the_sync_one_does(sessions_stack):
    import anyio

    from gradclient import AsyncClient

    net, data = bn_net(), batches(2)

    async def train() -> nn.Module:
        async with AsyncClient(sessions_stack.base_url, api_key=KEYS[0], timeout=120) as client:
            async with client.session(net, "sgd", lr=0.1, momentum=0.9) as s:
                for x, y in data:
                    await s.step(x, y)
                got = copy.deepcopy(net)
                await s.pull(got)
                assert (await s.info()).step == 2
        return got

    got = anyio.run(train)
    assert_same(got, local_training(net, data, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)), 1e-12, 1e-12)
