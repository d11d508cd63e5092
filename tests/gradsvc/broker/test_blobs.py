"""The worker's side of tensors by reference (gradsvc/broker/blobs.py BlobStore.resolved), on a private Redis: a
tensor's refs are resolved among its owner's pieces only, and what a resolved tensor's refs name is what its data
holds, whatever the body gave (the engine's resident models know a weight by its refs)."""

from __future__ import annotations

import time

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


def _held_bytes(r, owner: str) -> int:
    from gradsvc.broker import keys

    return sum(r.strlen(k) for k in r.scan_iter(match=keys.blob_key("test", owner, "*")))


def _use(store: BlobStore, owner: str, pieces: list[bytes]) -> None:
    """A request naming the pieces (the API's check), then a worker reading them (fetch)."""
    refs = [digest(p) for p in pieces]
    store.check(owner, request(Tensor(dtype="uint8", shape=[sum(len(p) for p in pieces)], refs=refs)))
    store.cache.clear()
    store.fetch(owner, refs)


def test_the_budget_counts_pieces_still_in_use_long_after_their_upload(redis_server):
    """Uploads, then uses for three TTLs, then more uploads: the budget still counts the pieces in use (the
    size index lived as long as they did), so the owner never holds more than it."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushdb()
    store = BlobStore(r, "test", ttl_s=1, budget_bytes=4096)
    first = [bytes([i]) * 1024 for i in range(4)]
    for piece in first:
        store.put("alice", digest(piece), piece)
    for _ in range(12):  # 3 s: three TTLs of uses
        _use(store, "alice", first)
        time.sleep(0.25)
    assert _held_bytes(r, "alice") == 4096
    for i in range(4, 12):
        piece = bytes([i]) * 1024
        store.put("alice", digest(piece), piece)
        assert _held_bytes(r, "alice") <= 4096


def test_the_budget_is_exact_under_interleaved_uploads_uses_and_expiries(redis_server):
    """A seeded mix of uploads, uses and idle waits (pieces expiring) for four TTLs: after each step the owner
    holds at most its budget, and every piece it holds is one its budget counts."""
    import random

    from gradsvc.broker import keys

    r = redis.Redis.from_url(redis_server.url)
    r.flushdb()
    store = BlobStore(r, "test", ttl_s=1, budget_bytes=5000)
    rng = random.Random(7)
    uploaded: list[bytes] = []
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        step = rng.random()
        if step < 0.5 or not uploaded:
            piece = rng.randbytes(rng.randint(1, 1500))
            store.put("alice", digest(piece), piece)
            uploaded.append(piece)
        elif step < 0.85:
            live = [p for p in uploaded[-6:] if r.exists(keys.blob_key("test", "alice", digest(p)))]
            if live:
                _use(store, "alice", live)
        else:
            time.sleep(rng.uniform(0.1, 0.6))
        held = {k.decode().rsplit(":", 1)[1] for k in r.scan_iter(match=keys.blob_key("test", "alice", "*"))}
        assert _held_bytes(r, "alice") <= 5000
        counted = {k.decode() for k in r.hkeys(keys.blob_sizes_key("test", "alice"))}
        assert held <= counted, held - counted


def test_an_empty_piece_is_refused_at_upload(store):
    with pytest.raises(BlobError) as empty:
        store.put("alice", digest(b""), b"")
    assert empty.value.code == "bad_tensor" and "0 bytes" in empty.value.message


def test_a_request_naming_more_refs_than_the_limit_is_refused_before_redis_is_asked(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    store = BlobStore(r, "test", ttl_s=60, budget_bytes=1 << 20, max_refs=8)
    refs = [digest(bytes([i])) for i in range(9)]
    with pytest.raises(BlobError) as many:
        store.check("alice", request(Tensor(dtype="uint8", shape=[9], refs=refs)))
    assert many.value.code == "too_many_refs" and many.value.detail == {"count": 9, "limit": 8}


def test_the_owners_runs_kept_weights_count_in_its_budget(redis_server):
    """A run keeps its last step's weights (gradsvc/broker/runs.py); they count beside the owner's pieces, so a
    piece that would take the owner over its budget evicts its least recently used pieces, as another piece would."""
    from gradsvc.broker import keys

    r = redis.Redis.from_url(redis_server.url)
    r.flushdb()
    store = BlobStore(r, "test", ttl_s=60, budget_bytes=100)
    r.hset(keys.run_weights_sizes_key("test", "alice"), "exp", 60)
    first, second = b"a" * 30, b"b" * 30
    assert store.put("alice", digest(first), first) == 0
    assert store.put("alice", digest(second), second) == 1  # 60 + 30 + 30 > 100: the first goes
    assert store.missing("alice", [digest(first), digest(second)]) == [digest(first)]
    assert store.put("bob", digest(first), first) == 0  # another owner's runs are not alice's
