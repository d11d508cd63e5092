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


def test_check_refreshes_each_pieces_ttl_and_lru_place_and_tells_what_is_lost(store):
    """The API's check (one script): a use refreshes each piece's TTL and moves it to the newest end of its
    owner's LRU index (a piece the index lost stays out of it); a piece not kept is tensor_not_found, pieces
    of the wrong total size bad_tensor; another owner's pieces are not there."""
    from gradsvc.broker import keys

    r = store.redis
    a, b = bytes(range(8)), bytes(range(8, 16))
    for piece in (a, b):
        store.put("alice", digest(piece), piece)
    index = keys.blob_index_key("test", "alice")
    for piece in (a, b):
        r.expire(keys.blob_key("test", "alice", digest(piece)), 5)
        r.zadd(index, {digest(piece): 1.0})
    r.zrem(index, digest(b))
    two = Tensor(dtype="float32", shape=[2, 2], refs=[digest(a), digest(b)])
    store.check("alice", request(two))
    for piece in (a, b):
        assert r.ttl(keys.blob_key("test", "alice", digest(piece))) > 50
    assert r.zscore(index, digest(a)) > 1e9 and r.zscore(index, digest(b)) is None
    with pytest.raises(BlobError) as short:
        store.check("alice", request(Tensor(dtype="float32", shape=[2, 2], refs=[digest(a)])))
    assert short.value.code == "bad_tensor" and short.value.detail["got_bytes"] == 8
    with pytest.raises(BlobError) as lost:
        store.check("bob", request(two))
    assert lost.value.code == "tensor_not_found" and lost.value.detail["refs"] == [digest(a), digest(b)]
    assert not r.exists(keys.blob_index_key("test", "bob"))  # bob's look made him no index
    r.script_flush()  # a Redis that restarted (or a new primary) has no scripts: loaded again
    store.check("alice", request(two))
