"""Tensors by reference over real HTTP, Redis and a worker: pieces go up once (PUT /tensors/{sha256}), a
request names them, only their owner can use or see them, a byte budget evicts the owner's least recently
used, and the SDK sends only what changed, uploading again what the service lost."""

from __future__ import annotations

import copy

import httpx
import pytest
import redis
import torch
from torch import nn
from torch.nn import functional as F

from gradclient import Client
from gradclient.refs import MIN_BYTES
from gradsvc.broker import blobs

from tests.support.stack import Stack, start_stack

KEYS = ("owner-a-0123456789", "owner-b-0123456789")
BUDGET = 4 << 20
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def secured() -> Stack:
    s = start_stack(workers=1, GRADSVC_API_KEYS=",".join(KEYS), GRADSVC_TENSOR_BUDGET_BYTES=str(BUDGET))
    yield s
    s.stop()


def http(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def wide_spec(weight_ref: list[str] | None = None, weight=None) -> dict:
    """Linear(256, 1024) (a 1 MiB weight), by reference or by value."""
    w = {"dtype": "float32", "shape": [1024, 256]}
    w.update({"refs": weight_ref} if weight_ref is not None else {"data": weight.tolist()})
    return {"model": {"layers": [{"type": "Linear", "in_features": 256, "out_features": 1024}], "dtype": "float32",
                      "weights": {"0.weight": w, "0.bias": {"dtype": "float32", "shape": [1024], "data": [0.0] * 1024}}},
            "inputs": [[0.01] * 256], "targets": [3], "options": {"numcheck": "off", "memory": False}}


def upload(c: httpx.Client, data: bytes) -> httpx.Response:
    return c.put(f"/tensors/{blobs.digest(data)}", content=data)


def test_a_piece_is_usable_and_visible_only_to_its_owner(secured):
    weight = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))
    data = weight.numpy().tobytes()
    ref = blobs.digest(data)
    with http(secured, KEYS[0]) as a, http(secured, KEYS[1]) as b:
        r = upload(a, data)
        assert r.status_code == 201 and r.json() == {"ref": ref, "bytes": len(data), "evicted": 0}
        by_ref = a.post("/gradients?wait=60", json=wide_spec([ref]))
        by_value = a.post("/gradients?wait=60", json=wide_spec(weight=weight))
        assert by_ref.status_code == 200, by_ref.text
        assert by_ref.json()["gradients"]["0.weight"] == by_value.json()["gradients"]["0.weight"]
        other = b.post("/gradients?wait=60", json=wide_spec([ref]))
        assert other.status_code == 422 and other.json()["error"]["code"] == "tensor_not_found", other.text
        assert "job_id" not in other.json()
        assert b.post("/tensors/missing", json={"refs": [ref]}).json() == {"missing": [ref]}
        assert a.post("/tensors/missing", json={"refs": [ref]}).json() == {"missing": []}
        estimate = b.post("/estimate", json=wide_spec([ref]))
        assert estimate.status_code == 422 and estimate.json()["error"]["code"] == "tensor_not_found"


def test_a_tensor_gives_its_bytes_inline_or_by_reference_not_both(secured):
    """A worker puts the owner's pieces in place of whatever a body gives beside refs, and its resident models
    know a weight by its refs: a tensor with both is refused before the queue, for its owner and any other key."""
    weight = torch.randn(1024, 256, generator=torch.Generator().manual_seed(1))
    data = weight.numpy().tobytes()
    with http(secured, KEYS[0]) as a, http(secured, KEYS[1]) as b:
        assert upload(a, data).status_code == 201
        for c in (a, b):
            body = wide_spec([blobs.digest(data)])
            body["model"]["weights"]["0.weight"]["data"] = torch.zeros(1024, 256).tolist()
            both = c.post("/gradients?wait=60", json=body)
            assert both.status_code == 422 and both.json()["error"]["code"] == "bad_tensor", both.text
            assert "not both" in both.json()["error"]["message"]
            assert both.json()["error"]["detail"]["where"] == "model.weights['0.weight']"


def test_a_piece_must_be_its_digest_and_refs_must_add_up(secured):
    with http(secured, KEYS[0]) as a:
        wrong = a.put(f"/tensors/{'0' * 64}", content=b"not those bytes")
        assert wrong.status_code == 422 and wrong.json()["error"]["code"] == "bad_tensor", wrong.text
        assert a.put("/tensors/not-a-digest", content=b"x").status_code == 400
        small = b"\x00" * 1024
        assert upload(a, small).status_code == 201
        short = a.post("/gradients?wait=60", json=wide_spec([blobs.digest(small)]))
        assert short.status_code == 422 and short.json()["error"]["code"] == "bad_tensor"
        assert "1024 bytes" in short.json()["error"]["message"]


def test_the_budget_evicts_the_owner_s_least_recently_used_pieces_only(secured):
    pieces = [bytes([i]) * (3 << 19) for i in range(3)]  # 1.5 MiB each: three pass the 4 MiB budget
    with http(secured, KEYS[0]) as a, http(secured, KEYS[1]) as b:
        keep = bytes([9]) * (3 << 19)
        assert upload(b, keep).status_code == 201
        answers = [upload(a, p).json() for p in pieces]
        assert [x["evicted"] >= 0 for x in answers] and sum(x["evicted"] for x in answers) >= 1
        missing = a.post("/tensors/missing", json={"refs": [blobs.digest(p) for p in pieces]}).json()["missing"]
        assert blobs.digest(pieces[0]) in missing and blobs.digest(pieces[2]) not in missing
        assert b.post("/tensors/missing", json={"refs": [blobs.digest(keep)]}).json() == {"missing": []}


class Backbone(nn.Module):
    """A frozen embedding and body (a few 1 MiB tensors) and a small trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 256)
        self.body = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        self.head = nn.Linear(256, 8)

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)).mean(1))  # (batch, 8)


def service_step(client: Client, model: nn.Module, ids, y, opt):
    """One SGD step with the service's gradients; its result."""
    result = client.gradients(model, ids, y, numcheck="off", memory=False)
    result.set_grads(model)
    opt.step()
    opt.zero_grad()
    return result


def test_a_frozen_backbone_trains_to_exactly_the_local_weights_sending_only_what_changed(secured):
    torch.manual_seed(0)
    model = Backbone()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head."))
    local = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    local_opt = torch.optim.SGD([p for p in local.parameters() if p.requires_grad], lr=0.5)
    ids, y = torch.randint(0, 1024, (4, 6)), torch.randint(0, 8, (4,))
    sent = []
    with Client(secured.base_url, api_key=KEYS[0], timeout=120) as client:
        for _ in range(4):
            result = service_step(client, model, ids, y, opt)
            local_opt.zero_grad()
            F.cross_entropy(local(ids), y).backward()
            local_opt.step()
            sent.append(result.upload_bytes)
        hashed = client._refs.hashed_bytes
    for (name, a), b in zip(model.state_dict().items(), local.state_dict().values()):
        assert torch.equal(a, b), name
    frozen = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("head."))
    assert sent[0] > frozen  # the backbone went up once ...
    assert all(s < frozen / 20 for s in sent[1:]), sent  # ... then only the body of the request
    big = sum(p.numel() * 4 for n, p in model.named_parameters() if p.numel() * 4 >= MIN_BYTES)
    assert hashed == big  # each large tensor hashed once: none of them changed


def test_pieces_the_service_lost_are_uploaded_again_by_the_sdk(secured):
    torch.manual_seed(1)
    model = Backbone()
    ids, y = torch.randint(0, 1024, (2, 3)), torch.randint(0, 8, (2,))
    with Client(secured.base_url, api_key=KEYS[1], timeout=120) as client:
        inline = client.gradients(model, ids, y, numcheck="off", memory=False)  # new trained weights: in the body
        first = client.gradients(model, ids, y, numcheck="off", memory=False)  # unchanged: up as pieces, once
        assert first.upload_bytes >= inline.upload_bytes * 0.9 and client._refs.uploaded
        r = redis.Redis.from_url(secured.redis.url)
        try:
            for key in r.scan_iter("*blob:*"):
                r.delete(key)  # every piece gone (expired, evicted, Redis restarted)
        finally:
            r.close()
        again = client.gradients(model, ids, y, numcheck="off", memory=False)
    assert again.upload_bytes >= first.upload_bytes * 0.9  # everything went up again, once
    assert {n: g.tolist() for n, g in again.gradients.items()} == {n: g.tolist() for n, g in first.gradients.items()}
    assert {n: g.tolist() for n, g in inline.gradients.items()} == {n: g.tolist() for n, g in first.gradients.items()}


def test_a_trained_weight_goes_in_the_body_while_it_changes_and_by_reference_once_it_does_not(secured):
    """Every weight trains (SGD): each step changes them all, so they go in the request body (one trip)
    rather than up as pieces kept for a reuse that never comes; a sweep with fixed weights sends them up
    once and then names them."""
    torch.manual_seed(2)
    model = Backbone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, y = torch.randint(0, 1024, (2, 3)), torch.randint(0, 8, (2,))
    large = sum(p.numel() * 4 for p in model.parameters() if p.numel() * 4 >= MIN_BYTES)
    with Client(secured.base_url, api_key=KEYS[1], timeout=120) as client:
        for _ in range(2):
            result = service_step(client, model, ids, y, opt)
            assert result.upload_bytes > large and not client._refs.uploaded  # all in the body, nothing kept
        assert client._refs.hashed_bytes == 0
        sweep = [client.gradients(model, ids, y, numcheck="off", memory=False).upload_bytes for _ in range(3)]
    assert sweep[0] > large and sweep[1] > large  # the last step's weights in the body, then up as pieces
    assert sweep[2] < large / 20, sweep  # then named only
