"""The store of validated graphs in Redis, by owner and ref.

The API stores every graph it validated under keys.graph_key(owner, ref) with a TTL
(GRADSVC_GRAPH_TTL_S) that each use refreshes; a worker given a graph_ref reads it from there, for the
job's owner. A ref is usable only by the owner (API key) that sent the graph: for another it is unknown,
as if never sent. Each process keeps an LRU of parsed graphs, so a graph seen before is neither fetched
nor decoded again. No Redis import: GraphStore is handed a client.
"""

from __future__ import annotations

from gradsvc.broker import keys
from gradsvc.hashing import decode, digest, encode
from gradsvc.lru import LRU
from gradsvc.wire import GraphSpec, owned


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
        owned(graph.constants)  # kept past the request whose body its constants' bytes may be views of
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
