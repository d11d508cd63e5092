"""Redis clients for the service's processes: redis-py with a packer that sends large values without
copying them (hiredis's C packer for the many small commands)."""

from __future__ import annotations

from typing import Any

from redis import Redis
from redis.connection import Encoder, HiredisRespSerializer, PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE


def sync_redis(url: str, **kwargs: Any) -> Redis:
    """A redis-py client for `url` that sends large values without copying them. With hiredis installed
    (the server extra installs it, for its reply parser) redis-py packs every command through
    hiredis.pack_command, which copies each argument twice: 36-56 ms per 33 MB SET here, on the path of
    every large request and result. redis-py's own packer sends a large value as it is (_Packer)."""
    return Redis.from_url(url, command_packer=_Packer(), **kwargs)


_BUFFER_CUTOFF = 6000  # redis-py's: values longer than this are sent as their own buffer
_LARGE = 1 << 16


class _Packer:
    """hiredis's packer (C) for commands of small values, most of a job's ~40; redis-py's (no copy of a
    large value, but Python per argument: 9% of a worker's time on small jobs here) for any larger one."""

    def __init__(self) -> None:
        self.python = PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)
        self.hiredis = HiredisRespSerializer() if HIREDIS_AVAILABLE else None

    def pack(self, *args: Any) -> list:
        if self.hiredis is None or any(isinstance(a, (bytes, bytearray, memoryview)) and len(a) > _LARGE
                                       for a in args):
            return self.python.pack(*args)
        return self.hiredis.pack(*args)
