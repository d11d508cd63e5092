"""Training sessions through the SDK, the API, Redis and two real workers: N session steps end on the weights of N
local torch.optim steps (a BatchNorm MLP in float64, a graph model in float32); a worker killed with SIGKILL
mid-run: the session comes back from its checkpoint on the other worker and, the lost steps sent again, ends on
the same weights; a retried step is answered again, never applied twice; the count and byte limits, and
concurrent creates at the count's limit; another key's session is a 404; the weights as safetensors (GET with
Accept: application/octet-stream, s.save); a run session's recorded update ratios; the diagnostics a step
answers or refuses; a forward that changes nothing; sessions of one frozen base on the worker holding it."""

from __future__ import annotations

import copy
import math
import os
import signal
import threading

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
KEYS = ("session-key-alice", "session-key-bob", "session-key-carol")
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


def test_an_async_session_steps_as_the_sync_one_does(sessions_stack, tmp_path):
    import anyio
    from safetensors.torch import load_file

    from gradclient import AsyncClient

    net, data = bn_net(), batches(3)

    async def train() -> nn.Module:
        async with AsyncClient(sessions_stack.base_url, api_key=KEYS[0], timeout=120) as client:
            async with client.session(net, "sgd", lr=0.1, momentum=0.9) as s:
                await s.step(*data[0])
                await s.forward_backward(*data[1])
                assert (await s.optim_step()).step == 2
                await s.step(*data[2])
                got = copy.deepcopy(net)
                await s.pull(got)  # the BatchNorm's running statistics too
                await s.save(str(tmp_path / "async.safetensors"))
                state = await s.state_dict()
                assert (await s.info()).step == 3
        assert state.keys() == got.state_dict().keys()
        return got

    got = anyio.run(train)
    assert_same(got, local_training(net, data, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)), 1e-12, 1e-12)
    saved = load_file(str(tmp_path / "async.safetensors"))
    assert all(torch.equal(saved[n], v) for n, v in got.state_dict().items())


def test_concurrent_creates_at_the_count_limit_let_exactly_the_room_in(sessions_stack):
    """Twelve POST /sessions at once over HTTP for a key with room for three: three 201, nine 429 (the count and the
    record are one step in Redis), and the key then holds three."""
    body = {"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 1}]},
            "optimizer": {"type": "sgd"}}
    start, answers = threading.Barrier(12), []

    def create() -> None:
        with httpx.Client(base_url=sessions_stack.base_url, timeout=120,
                          headers={"Authorization": f"Bearer {KEYS[2]}"}) as http:
            start.wait()
            answers.append(http.post("/sessions", json=body))

    threads = [threading.Thread(target=create) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [201] * 3 + [429] * 9, [r.text[:200] for r in answers]
    refused = next(r.json()["error"] for r in answers if r.status_code == 429)
    assert refused["code"] == "too_many_sessions" and "GRADSVC_SESSION_MAX_PER_OWNER=3" in refused["message"]
    with httpx.Client(base_url=sessions_stack.base_url, headers={"Authorization": f"Bearer {KEYS[2]}"}) as http:
        for r in answers:
            if r.status_code == 201:
                assert http.delete(f"/sessions/{r.json()['session_id']}").status_code == 200


def test_the_weights_come_as_safetensors_under_octet_stream_and_save_writes_them(sessions_stack, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load, load_file

    net, data = bn_net(), batches(3)
    want = local_training(net, data, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    with client_for(sessions_stack) as client, client.session(net, "sgd", lr=0.1, momentum=0.9) as s:
        for x, y in data:
            s.step(x, y)
        with httpx.Client(base_url=sessions_stack.base_url, headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
            r = http.get(f"/sessions/{s.session_id}/weights", headers={"Accept": "application/octet-stream"})
        s.save(str(tmp_path / "session.safetensors"))
        state = s.state_dict()
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/octet-stream")
    got, saved = load(r.content), load_file(str(tmp_path / "session.safetensors"))
    assert got.keys() == saved.keys() == want.state_dict().keys() == state.keys()  # buffers included
    with safe_open(str(tmp_path / "session.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "3"
    for name, value in want.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=name)
        assert torch.equal(saved[name], got[name]) and torch.equal(state[name], got[name]), name
    local = copy.deepcopy(net)
    local.load_state_dict(saved)  # what s.save writes loads into the local module as it is


def test_a_run_sessions_steps_record_the_update_ratio_as_a_gradients_run_does(sessions_stack):
    """Step t records |w_t - w_(t-1)| / |w_(t-1)| per module (docs/runs.md), w_t the weights its gradient was
    taken at: null on step 0, then the previous update's, equal to the local loop's to 1e-9."""
    net, data = bn_net(), batches(4)
    local = copy.deepcopy(net)
    opt = torch.optim.Adam(local.parameters(), lr=1e-2)
    weights = [{n: p.detach().clone() for n, p in local.named_parameters()}]
    for x, y in data:
        F.cross_entropy(local(x), y).backward()
        opt.step()
        opt.zero_grad()
        weights.append({n: p.detach().clone() for n, p in local.named_parameters()})
    with client_for(sessions_stack) as client, client.session(net, "adam", lr=1e-2, run="ratio-run") as s:
        for x, y in data:
            s.step(x, y)
    with httpx.Client(base_url=sessions_stack.base_url, headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
        steps = http.get("/runs/ratio-run").json()["steps"]
        http.delete("/runs/ratio-run")
    assert [st["step"] for st in steps] == [0, 1, 2, 3] and steps[0]["update_ratio"] is None
    for t in range(1, 4):
        want = {}
        for module in ("0", "1", "3"):
            names = [n for n in weights[t] if n.rpartition(".")[0] == module]
            moved = sum(float((weights[t][n] - weights[t - 1][n]).pow(2).sum()) for n in names)
            base = sum(float(weights[t - 1][n].pow(2).sum()) for n in names)
            want[module] = math.sqrt(moved / base)
        assert steps[t]["update_ratio"].keys() == want.keys()
        for module, ratio in want.items():
            assert steps[t]["update_ratio"][module] == pytest.approx(ratio, rel=1e-9), (t, module)


def test_a_step_answers_the_gradient_norms_and_refuses_the_per_example_diagnostics_with_a_coded_422(sessions_stack):
    x, y = batches(1)[0]
    with client_for(sessions_stack) as client, client.session(bn_net(), "sgd", lr=0.1) as s:
        out = s.step(x, y, diagnostics=["norms"])
        assert out.raw.diagnostics.norms.global_ == pytest.approx(out.grad_norm, rel=1e-12)
        body = {"inputs": msgspec.to_builtins(to_wire(x, "json")), "targets": msgspec.to_builtins(to_wire(y, "json")),
                "options": {"diagnostics": ["norms", "variance"]}}
        with sessions_stack.http_client() as http:
            r = http.post(f"/sessions/{s.session_id}/step", json=body,
                          headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "bad_option" and error["detail"]["option"] == "options.diagnostics"
        assert "POST /gradients" in error["message"] and "GET /sessions/{id}/weights" in error["message"]
        assert s.info().step == 1  # the refused step changed nothing


def test_a_forward_answers_the_local_forward_of_the_trained_weights_and_changes_nothing(sessions_stack):
    torch.manual_seed(3)
    net = TinyLM()
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 13, (4, 6), generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]
    want = local_training(net, data[:2], lambda p: torch.optim.AdamW(p, lr=1e-2))
    x, y = data[2]
    logits = want(x).detach()
    with client_for(sessions_stack) as client, client.session(net, "adamw", lr=1e-2) as s:
        for xb, yb in data[:2]:
            s.step(xb, yb)
        out = s.forward(x, y, returns=["outputs"])
        assert out.step == 2 and s.info().step == 2
        assert out.loss == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5)
        torch.testing.assert_close(out.logprobs, -F.cross_entropy(logits, y, reduction="none"), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.outputs, logits, rtol=1e-5, atol=1e-6)
        assert s.forward(x).loss is None  # no targets: the outputs alone
        got = copy.deepcopy(net)
        s.pull(got)
        body = {"inputs": msgspec.to_builtins(to_wire(x, "json")), "targets": msgspec.to_builtins(to_wire(y, "json"))}
        with sessions_stack.http_client() as http:
            auth = {"Authorization": f"Bearer {KEYS[0]}"}
            answer = http.post(f"/sessions/{s.session_id}/forward", json=body, headers=auth)
            refused = http.post(f"/sessions/{s.session_id}/forward", json={**body, "lr": 0.5}, headers=auth)
    assert_same(got, want, rtol=1e-6, atol=1e-7)  # the forwards changed nothing
    assert answer.status_code == 200 and answer.json()["logprobs"]["loss"]["shape"] == [4], answer.text
    assert refused.status_code == 422 and refused.json()["error"]["detail"]["option"] == "lr", refused.text


def test_sessions_of_one_frozen_base_go_to_the_worker_holding_it_whichever_key_sends_them(sessions_stack):
    """Affinity by base: the frozen layer (64 KiB, sent by reference) is one base; each key uploads its pieces, and
    every session of it, of three keys, is built on the worker the first one was (by chance: 1 in 8 of 2 workers)."""
    torch.manual_seed(5)
    base = nn.Linear(128, 128).requires_grad_(False)
    x, y = torch.randn(4, 128), torch.randint(0, 3, (4,))
    workers, sessions = [], []
    with client_for(sessions_stack, KEYS[0]) as alice, client_for(sessions_stack, KEYS[1]) as bob, \
            client_for(sessions_stack, KEYS[2]) as carol:
        for client in (alice, bob, carol, alice):
            torch.manual_seed(len(sessions))
            s = client.session(nn.Sequential(copy.deepcopy(base), nn.Tanh(), nn.Linear(128, 3)), "sgd", lr=0.1)
            s.step(x, y)
            sessions.append(s)
            workers.append(s.info().worker)
        for s in sessions:
            s.delete()
    assert len(set(workers)) == 1, workers


def test_integers_sent_as_integral_floats_are_taken_and_options_lists_both_methods(sessions_stack):
    """What schemathesis found once the routes were in GET /schema: `numcheck_samples: 4.0` (a JSON Schema
    integer) was a 400, and OPTIONS /sessions/{id} left DELETE out of Allow."""
    x, y = batches(1)[0]
    with client_for(sessions_stack) as client, client.session(bn_net(), "sgd", lr=0.1) as s:
        s.step(x, y)  # the SDK creates the session with its first batch
        body = {"inputs": msgspec.to_builtins(to_wire(x, "json")), "targets": msgspec.to_builtins(to_wire(y, "json")),
                "options": {"numcheck_samples": 4.0}}
        with httpx.Client(base_url=sessions_stack.base_url, headers={"Authorization": f"Bearer {KEYS[0]}"}) as http:
            r = http.post(f"/sessions/{s.session_id}/step", json=body)
            assert r.status_code == 200 and r.json()["step"] == 2, r.text
            allow = http.options(f"/sessions/{s.session_id}").headers["allow"]
            empty = http.post("/sessions", json={"model": {}, "optimizer": {"type": "sgd"}})
    assert {m.strip() for m in allow.split(",")} == {"DELETE", "GET", "OPTIONS"}
    assert empty.status_code == 422 and "exactly one of 'layers', 'graph' or 'graph_ref'" in empty.json()["error"][
        "message"]
