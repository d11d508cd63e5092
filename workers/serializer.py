"""RQ's serializer for gradsvc queues: MessagePack via msgspec, so no pickle crosses Redis.

Passed to RQ as a class (or the dotted path "workers.serializer.MsgpackSerializer"): RQ's
worker resolves serializers by class, not instance.
"""

from __future__ import annotations

from typing import Any

import msgspec

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class MsgpackSerializer:
    @staticmethod
    def dumps(obj: Any) -> bytes:
        return _encoder.encode(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        return _decoder.decode(data)
