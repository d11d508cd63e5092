"""The one bounded cache: least recently used out, by entry count or by bytes, behind one lock.

Every cache of the project (parsed graphs, validated graphs, built models, shape facts, estimates,
tensor pieces) is an `LRU` owned by an object the API or the worker creates, never module state.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T")


class LRU(Generic[T]):
    """A bounded map. `entries` caps how many values it keeps; `max_bytes` (with `size`, the bytes of a
    value) caps what they weigh; either or both. One lock around every access: the API reads it from
    several threads (anyio's worker threads) at once. `hits`/`misses` count `get`s and `take`s; `evictions` the values
    `put` let go to stay within the bounds, and those `clear` dropped."""

    def __init__(self, entries: int | None = None, *, max_bytes: int | None = None,
                 size: Callable[[T], int] = len) -> None:  # type: ignore[assignment]
        self.entries = entries
        self.max_bytes = max_bytes
        self._size = size
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._items: OrderedDict[Hashable, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> T | None:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
                return None
            self.hits += 1
            self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: T) -> None:
        weight = self._size(value) if self.max_bytes is not None else 0
        if self.max_bytes is not None and weight > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None and self.max_bytes is not None:
                self.bytes -= self._size(old)
            self._items[key] = value
            self.bytes += weight
            while ((self.entries is not None and len(self._items) > self.entries)
                   or (self.max_bytes is not None and self.bytes > self.max_bytes)):
                _, dropped = self._items.popitem(last=False)
                self.evictions += 1
                if self.max_bytes is not None:
                    self.bytes -= self._size(dropped)

    def pop(self, key: Hashable) -> T | None:
        with self._lock:
            value = self._items.pop(key, None)
            if value is not None and self.max_bytes is not None:
                self.bytes -= self._size(value)
            return value

    def take(self, key: Hashable) -> T | None:
        """pop(), counted as a hit or a miss (a value checked out for exclusive use, put back after)."""
        value = self.pop(key)
        with self._lock:
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
        return value

    def peek(self, key: Hashable) -> T | None:
        """The value, if kept; no hit or miss counted, its place in the order unchanged."""
        with self._lock:
            return self._items.get(key)

    def values(self) -> list[T]:
        """A snapshot of the values, least recently used first (for tests and metrics; no hit counted)."""
        with self._lock:
            return list(self._items.values())

    def clear(self) -> None:
        with self._lock:
            self.evictions += len(self._items)
            self._items.clear()
            self.bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
