"""A graph's content hash (its `graph_ref`): the sha256 of its canonical MessagePack (map keys sorted).

The same graph sent by JSON or MessagePack, with its keys in any order, has one ref once decoded.
No torch, no Redis: the engine, the API and the store all hash the same way.
"""

from __future__ import annotations

import hashlib

import msgspec

from gradsvc.wire import GraphSpec

_canonical = msgspec.msgpack.Encoder(order="sorted")
_decoder = msgspec.msgpack.Decoder(GraphSpec)


def encode(graph: GraphSpec) -> bytes:
    """The canonical MessagePack bytes of `graph` (what is stored under its ref)."""
    return _canonical.encode(graph)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode(data: bytes) -> GraphSpec:
    return _decoder.decode(data)
