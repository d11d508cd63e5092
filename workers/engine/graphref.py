"""graph_ref: a graph's content hash, and a small thread-safe LRU of parsed graphs kept by it.

The hash is the sha256 of the graph's canonical MessagePack (map keys sorted), so the same graph
sent by JSON or MessagePack, with its keys in any order, has one ref once decoded. The API and
the workers each keep an LRU: a graph seen before is neither fetched, decoded nor validated again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Generic, TypeVar

import msgspec

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
