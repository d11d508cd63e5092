"""The worker's side of tensors by reference (gradsvc/broker/blobs.py BlobStore.resolved), on a private Redis: a
tensor's refs are resolved among its owner's pieces only, and what a resolved tensor's refs name is what its data
holds, whatever the body gave (the engine's resident models know a weight by its refs)."""

from __future__ import annotations

import msgspec
import pytest
import redis

from gradsvc.broker.blobs import BlobError, BlobStore, digest
from gradsvc.wire import GradientRequest, Tensor


@pytest.fixture()
def store(redis_server) -> BlobStore:
    r = redis.Redis.from_url(redis_server.url)
    r.flushdb()
    return BlobStore(r, "test", ttl_s=60, budget_bytes=1 << 20, cache_bytes=1 << 20)


def request(weight: Tensor) -> GradientRequest:
    return msgspec.convert({"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}],
                                      "weights": {"0.weight": msgspec.to_builtins(weight)}},
                            "inputs": [[0.0, 1.0]], "targets": [1]}, GradientRequest)


def test_resolved_tensors_hold_the_owners_pieces_under_their_refs_whatever_the_body_gave(store):
    piece = bytes(range(16))
    store.put("alice", digest(piece), piece)
    forged = Tensor(dtype="float32", shape=[2, 2], data=b"\x00" * 16, refs=[digest(piece)])
    weight = store.resolved("alice", request(forged)).model.weights["0.weight"]
    assert weight.data == piece and weight.refs == [digest(piece)]
    with pytest.raises(BlobError) as lost:  # another owner's piece is not there for bob
        store.resolved("bob", request(forged))
    assert lost.value.code == "tensor_not_found"


def test_a_piece_in_the_workers_cache_is_its_owners_only(store):
    piece = bytes(range(16, 32))
    store.put("alice", digest(piece), piece)
    by_ref = Tensor(dtype="float32", shape=[2, 2], refs=[digest(piece)])
    assert store.resolved("alice", request(by_ref)).model.weights["0.weight"].data == piece  # now cached here
    with pytest.raises(BlobError):
        store.resolved("bob", request(by_ref))
