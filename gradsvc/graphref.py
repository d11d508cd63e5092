"""graph_ref: a graph's content hash, a small thread-safe LRU, and the store of validated graphs in Redis.

The hash is the sha256 of the graph's canonical MessagePack (map keys sorted), so the same graph
sent by JSON or MessagePack, with its keys in any order, has one ref once decoded. The API stores
every graph it validated under keys.graph_key(owner, ref) with a TTL (GRADSVC_GRAPH_TTL_S) that each
use refreshes; a worker given a graph_ref reads it from there, for the job's owner. A ref is usable
only by the owner (API key) that sent the graph: for another it is unknown, as if never sent. Each process keeps an LRU of parsed
graphs (GraphStore) and the engine one of validated graphs, so a graph seen before is neither
fetched, decoded nor validated again. No torch, and no Redis import: GraphStore is handed a client.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Generic, TypeVar

import msgspec

from gradsvc import keys
from gradsvc.wire import GraphSpec

_canonical = msgspec.msgpack.Encoder(order="sorted")
_decoder = msgspec.msgpack.Decoder(GraphSpec)

T = TypeVar("T")


def encode(graph: GraphSpec) -> bytes:
    """The canonical MessagePack bytes of `graph` (what is stored under its ref)."""
    return _canonical.encode(graph)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode(data: bytes) -> GraphSpec:
    return _decoder.decode(data)


class LRU(Generic[T]):
    """A bounded map, least recently used first out. One lock around every access: the API reads it
    from several threads (anyio's worker threads) at once."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: OrderedDict[object, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: object) -> T | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: object, value: T) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class GraphStore:
    """Validated graphs in Redis by owner and ref (never pickled: canonical MessagePack, decoded into the
    Struct). The LRU is keyed by both too: a graph this process holds for one owner is not another's."""

    def __init__(self, redis, prefix: str, ttl_s: int, entries: int = 64) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.parsed: LRU[GraphSpec] = LRU(entries)

    def put(self, owner: str, ref: str, graph: GraphSpec, data: bytes) -> None:
        """Keeps `graph` (its canonical bytes `data`, whose sha256 is `ref`) for `owner`, for the TTL."""
        self.redis.set(keys.graph_key(self.prefix, owner, ref), data, ex=self.ttl_s)
        self.parsed.put((owner, ref), graph)

    def resolver(self, owner: str):
        """`get` for one owner: what the engine's prepare() takes as `graphs` (ref -> graph or None)."""
        return lambda ref: self.get(owner, ref)

    def get(self, owner: str, ref: str) -> GraphSpec | None:
        """The graph `owner` stored under `ref`, its TTL refreshed; None when it is unknown, expired or
        another owner's."""
        key = keys.graph_key(self.prefix, owner, ref)
        graph = self.parsed.get((owner, ref))
        if graph is not None:
            if not self.redis.expire(key, self.ttl_s):
                # Expired in Redis while this process still held it: store it again rather than refuse it.
                self.redis.set(key, encode(graph), ex=self.ttl_s)
            return graph
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(key)
            pipe.expire(key, self.ttl_s)
            data, _ = pipe.execute()
        if data is None or digest(data) != ref:
            return None
        graph = decode(data)
        self.parsed.put((owner, ref), graph)
        return graph
