"""The resend policy is one (gradclient/base.py): Client and AsyncClient answer a service that lost a weight
piece (422 tensor_not_found) the same way, by uploading the pieces again and sending the body once more
under a new Idempotency-Key, and give up after that one resend."""

from __future__ import annotations

import anyio
import httpx
import msgspec
import pytest
import torch
from torch import nn

from gradclient import AsyncClient, Client, errors
from gradsvc import wire

LOST = msgspec.json.encode({"error": {"code": "tensor_not_found", "message": "lost (mock)", "detail": {}}})
ACCEPTED = msgspec.json.encode(wire.JobAccepted(job_id="j-1", status="queued"))


def service(lost_posts: int):
    """A mock API whose first `lost_posts` POST /gradients answer tensor_not_found; records what it saw."""
    seen: list[tuple[str, str, str | None]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.headers.get("idempotency-key")))
        json = {"content-type": "application/json"}
        if request.method == "PUT":
            return httpx.Response(204)
        if sum(1 for m, _, _ in seen if m == "POST") <= lost_posts:
            return httpx.Response(422, content=LOST, headers=json)
        return httpx.Response(202, content=ACCEPTED, headers=json)

    return seen, httpx.MockTransport(handle)


def call(kind: str, transport: httpx.MockTransport, model: nn.Module):
    x, y = torch.randn(2, 128), torch.tensor([0, 1])
    if kind == "sync":
        with Client("http://gradsvc.test", retries=0, transport=transport) as client:
            return client.submit(model, x, y)

    async def main():
        async with AsyncClient("http://gradsvc.test", retries=0, transport=transport) as client:
            return await client.submit(model, x, y)

    return anyio.run(main)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_lost_piece_is_uploaded_again_and_the_body_sent_once_more(kind):
    seen, transport = service(lost_posts=1)
    job = call(kind, transport, nn.Sequential(nn.Linear(128, 128)))  # a 64 KiB weight: sent by reference
    puts = [p for m, p, _ in seen if m == "PUT"]
    posts = [k for m, _, k in seen if m == "POST"]
    assert job.job_id == "j-1" and len(puts) == 2 and puts[0] == puts[1]
    assert len(posts) == 2 and posts[0] != posts[1] and None not in posts


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_piece_lost_twice_raises_after_one_resend(kind):
    seen, transport = service(lost_posts=2)
    with pytest.raises(errors.TensorNotFoundError):
        call(kind, transport, nn.Sequential(nn.Linear(128, 128)))
    assert sum(1 for m, _, _ in seen if m == "POST") == 2
