"""Validated graphs in Redis by content hash (`model.graph_ref`), shared by the API and the workers.

The API stores every graph it validated under keys.graph_key(ref) with a TTL (GRADSVC_GRAPH_TTL_S)
that each use refreshes; a worker given a graph_ref reads it from there. The bytes are the graph's
canonical MessagePack, decoded into the wire Struct: never pickled. Each process keeps a small LRU
of parsed graphs, so a graph seen before costs one EXPIRE, not a GET and a decode.
"""

from __future__ import annotations

from redis import Redis

from gradsvc import keys
from gradsvc.wire import GraphSpec
from workers.engine import graphref


class GraphStore:
    def __init__(self, redis: Redis, prefix: str, ttl_s: int, entries: int = 64) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.parsed: graphref.LRU[GraphSpec] = graphref.LRU(entries)

    def put(self, ref: str, graph: GraphSpec, data: bytes) -> None:
        """Keeps `graph` (its canonical bytes `data`, whose sha256 is `ref`) for the TTL."""
        self.redis.set(keys.graph_key(self.prefix, ref), data, ex=self.ttl_s)
        self.parsed.put(ref, graph)

    def get(self, ref: str) -> GraphSpec | None:
        """The graph stored under `ref`, its TTL refreshed; None when it is unknown or expired."""
        key = keys.graph_key(self.prefix, ref)
        graph = self.parsed.get(ref)
        if graph is not None:
            if not self.redis.expire(key, self.ttl_s):
                # Expired in Redis while this process still held it: store it again rather than refuse it.
                self.redis.set(key, graphref.encode(graph), ex=self.ttl_s)
            return graph
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(key)
            pipe.expire(key, self.ttl_s)
            data, _ = pipe.execute()
        if data is None or graphref.digest(data) != ref:
            return None
        graph = graphref.decode(data)
        self.parsed.put(ref, graph)
        return graph
