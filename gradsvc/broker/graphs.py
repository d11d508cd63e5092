"""The store of validated graphs in Redis, by owner and ref.

The API stores every graph it validated under keys.graph_key(owner, ref) with a TTL
(GRADSVC_GRAPH_TTL_S) that each use refreshes; a worker given a graph_ref reads it from there, for the
job's owner. A ref is usable only by the owner (API key) that sent the graph: for another it is unknown,
as if never sent. Each process keeps an LRU of parsed graphs, so a graph seen before is neither fetched
nor decoded again. No Redis import: GraphStore is handed a client.

A worker's store refreshes a held graph's TTL after the job (`deferred`): a hit in its LRU costs the job no Redis
round trip (one in prepare was 0.2 ms, and 2-10 ms in two jobs of five on a loaded 2-core host, in a prepare of
1.5 ms), and the worker's reaper thread sends the refreshes due (refresh_due) once the job ended: at most one per
graph per REFRESH_S, to the TTL plus REFRESH_S, so a graph still stays known at least the TTL after its last use.
A key that expired or was lost meanwhile (Redis restarted empty) is stored again, as the synchronous path does.
"""

from __future__ import annotations

import threading
import time

from gradsvc.broker import keys
from gradsvc.hashing import decode, digest, encode
from gradsvc.lru import LRU
from gradsvc.wire import GraphSpec, owned


# The most often a deferred store refreshes one graph's TTL (seconds; a tenth of the TTL when that is shorter).
REFRESH_S = 10.0


class GraphStore:
    """Validated graphs in Redis by owner and ref (never pickled: canonical MessagePack, decoded into the
    Struct). The LRU is keyed by both too: a graph this process holds for one owner is not another's.
    `deferred`: an LRU hit's TTL refresh waits for refresh_due() (a worker's, after the job) instead of
    costing the caller a round trip."""

    def __init__(self, redis, prefix: str, ttl_s: int, entries: int = 64, deferred: bool = False) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.parsed: LRU[GraphSpec] = LRU(entries)
        self.deferred = deferred
        self.refresh_s = min(REFRESH_S, ttl_s / 10)
        self.refreshed: LRU[float] = LRU(entries * 4)  # (owner, ref) -> when a refresh was last due (monotonic)
        self._due: dict[tuple[str, str], GraphSpec] = {}  # refreshes for refresh_due() to send
        self._lock = threading.Lock()  # _due: filled by jobs, emptied by the reaper thread

    def put(self, owner: str, ref: str, graph: GraphSpec, data: bytes) -> None:
        """Keeps `graph` (its canonical bytes `data`, whose sha256 is `ref`) for `owner`, for the TTL."""
        self.redis.set(keys.graph_key(self.prefix, owner, ref), data, ex=self.ttl_s)
        owned(graph.constants)  # kept past the request whose body its constants' bytes may be views of
        self.parsed.put((owner, ref), graph)

    def resolver(self, owner: str):
        """`get` for one owner: what the engine's prepare() takes as `graphs` (ref -> graph or None)."""
        return lambda ref: self.get(owner, ref)

    def get(self, owner: str, ref: str) -> GraphSpec | None:
        """The graph `owner` stored under `ref`, its TTL refreshed (`deferred`: by the next refresh_due()); None
        when it is unknown, expired or another owner's."""
        key = keys.graph_key(self.prefix, owner, ref)
        graph = self.parsed.get((owner, ref))
        if graph is not None:
            if self.deferred:
                self._defer(owner, ref, graph)
            elif not self.redis.expire(key, self.ttl_s):
                # Expired in Redis while this process still held it: store it again rather than refuse it.
                self.redis.set(key, encode(graph), ex=self.ttl_s)
            return graph
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(key)
            pipe.expire(key, self.ttl_s if not self.deferred else self._deferred_ttl())
            data, _ = pipe.execute()
        if data is None or digest(data) != ref:
            return None
        graph = decode(data)
        self.parsed.put((owner, ref), graph)
        if self.deferred:
            self.refreshed.put((owner, ref), time.monotonic())  # refreshed just now, by the pipeline above
        return graph

    def _deferred_ttl(self) -> int:
        """A deferred refresh's TTL: the next one may come refresh_s later."""
        return int(self.ttl_s + self.refresh_s + 0.999)

    def _defer(self, owner: str, ref: str, graph: GraphSpec) -> None:
        """Marks the graph's refresh due unless one was due less than refresh_s ago."""
        now = time.monotonic()
        last = self.refreshed.get((owner, ref))
        if last is not None and now - last < self.refresh_s:
            return
        self.refreshed.put((owner, ref), now)
        with self._lock:
            self._due[(owner, ref)] = graph

    def pending(self) -> bool:
        """Whether refresh_due() has refreshes to send."""
        return bool(self._due)

    def refresh_due(self) -> int:
        """Sends the refreshes due, in one round trip (a graph whose key expired or was lost: stored again);
        how many. Called off the job's path (a worker's reaper thread), so each lasts the TTL plus refresh_s."""
        with self._lock:
            due, self._due = self._due, {}
        if not due:
            return 0
        items = list(due.items())
        ttl = self._deferred_ttl()
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                for (owner, ref), _ in items:
                    pipe.expire(keys.graph_key(self.prefix, owner, ref), ttl)
                found = pipe.execute()
            lost = [(owner, ref, graph) for ((owner, ref), graph), ok in zip(items, found) if not ok]
            if lost:
                with self.redis.pipeline(transaction=False) as pipe:
                    for owner, ref, graph in lost:
                        pipe.set(keys.graph_key(self.prefix, owner, ref), encode(graph), ex=ttl)
                    pipe.execute()
        except Exception:
            with self._lock:  # due again: the next call sends them
                for k, graph in due.items():
                    self._due.setdefault(k, graph)
            raise
        return len(items)
