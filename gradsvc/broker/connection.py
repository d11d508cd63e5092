"""Redis clients for the service's processes: redis-py with a packer that sends large values without
copying them (hiredis's C packer for the many small commands), to GRADSVC_REDIS_URL's server or, with
GRADSVC_REDIS_SENTINELS set, to whichever server the sentinels name as GRADSVC_REDIS_SENTINEL_MASTER's
master now (each new connection asks them, so a failover is followed by reconnecting)."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence
from typing import Any, Self
from urllib.parse import unquote, urlparse

import redis.asyncio as aioredis
from redis import Redis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.connection import Encoder, PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, MasterDownError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import Sentinel
from redis.utils import HIREDIS_AVAILABLE

from gradsvc.runtime.settings import Settings

if HIREDIS_AVAILABLE:
    import hiredis
    from redis._parsers.hiredis import NOT_ENOUGH_DATA
else:
    NOT_ENOUGH_DATA = object()


# Redis answering but refusing writes: at maxmemory (OOM), a replica (READONLY: a failover demoted it), a
# master that cannot snapshot (MISCONF) or lacks its min-replicas (NOREPLICAS), a replica cut from its master
# (MASTERDOWN), a blocked read cut by a demotion (UNBLOCKED: the failover itself). redis-py raises its own class for some, a plain ResponseError for the rest; inside a pipeline
# it rewrites the message ("Command # 1 (...) of pipeline caused error: ..."), so the class is read first.
REFUSAL_ERRORS = (OutOfMemoryError, ReadOnlyError, MasterDownError)
_REFUSAL_CODES = {OutOfMemoryError: "redis_oom", ReadOnlyError: "redis_readonly", MasterDownError: "redis_unavailable"}
_REFUSAL_WORDS = re.compile(r"(?:^|caused error: )(OOM|READONLY|MISCONF|NOREPLICAS|MASTERDOWN|UNBLOCKED)\b")
_WORD_CODES = {"OOM": "redis_oom", "READONLY": "redis_readonly"}


def refusal(exc: BaseException) -> str | None:
    """The error code of Redis refusing writes (redis_oom, redis_readonly, redis_unavailable), or None when
    `exc` is something else."""
    if not isinstance(exc, ResponseError):
        return None
    for cls, code in _REFUSAL_CODES.items():
        if isinstance(exc, cls):
            return code
    found = _REFUSAL_WORDS.search(str(exc))
    return _WORD_CODES.get(found.group(1), "redis_unavailable") if found else None


def sync_redis(url: str, **kwargs: Any) -> Redis:
    """A redis-py client for `url` that sends large values without copying them. With hiredis installed
    (the server extra installs it, for its reply parser) redis-py packs every command through
    hiredis.pack_command, which copies each argument twice: 36-56 ms per 33 MB SET here, on the path of
    every large request and result. redis-py's own packer sends a large value as it is (_Packer)."""
    return Redis.from_url(url, command_packer=_Packer(), **kwargs)


def connect(settings: Settings, **kwargs: Any) -> Redis:
    """The sync client every API and worker connection goes through (RQ's included): GRADSVC_REDIS_URL's
    server, or the sentinels' current master."""
    if not settings.redis_sentinels:
        return sync_redis(settings.redis_url, **kwargs)
    return Sentinel(sentinel_addresses(settings), **_sentinel_kwargs(settings)).master_for(
        settings.redis_sentinel_master, command_packer=_Packer(), **_url_auth(settings.redis_url), **kwargs)


def connect_async(settings: Settings, **kwargs: Any) -> aioredis.Redis:
    """connect()'s asyncio twin (the API's event loop)."""
    if not settings.redis_sentinels:
        return aioredis.from_url(settings.redis_url, **kwargs)
    return AsyncSentinel(sentinel_addresses(settings), **_sentinel_kwargs(settings)).master_for(
        settings.redis_sentinel_master, **_url_auth(settings.redis_url), **kwargs)


def sentinel_addresses(settings: Settings) -> list[tuple[str, int]]:
    """GRADSVC_REDIS_SENTINELS ("host:port,host:port") as (host, port) pairs (Settings.validate checked them)."""
    out = []
    for entry in settings.redis_sentinels:
        host, _, port = entry.rpartition(":")
        out.append((host.strip("[]"), int(port)))
    return out


def _sentinel_kwargs(settings: Settings) -> dict[str, Any]:
    # The sentinels themselves: short timeouts, so a dead one costs a connect timeout and the next is asked.
    timeout = settings.redis_timeout_s
    return {"sentinel_kwargs": {"socket_connect_timeout": timeout, "socket_timeout": timeout}}


def _url_auth(url: str) -> dict[str, Any]:
    """What GRADSVC_REDIS_URL still says with sentinels on: the db number and the master's credentials
    (its host and port are the sentinels' to name)."""
    parsed = urlparse(url)
    out: dict[str, Any] = {"db": int(parsed.path.lstrip("/") or 0)}
    if parsed.username:
        out["username"] = unquote(parsed.username)
    if parsed.password:
        out["password"] = unquote(parsed.password)
    return out


_BUFFER_CUTOFF = 6000  # redis-py's: values longer than this are sent as their own buffer
_LARGE = 1 << 16


_VIEWS = (bytearray, memoryview)


class _Packer:
    """hiredis's packer (C) for commands of small values, most of a job's ~40; redis-py's (no copy of a
    large value, but Python per argument: 9% of a worker's time on small jobs here) for any larger one.
    hiredis.pack_command is called directly, not through redis-py's HiredisRespSerializer, whose isinstance
    checks and generator over every argument took most of each command's packing: 10 -> 3 us for an HSET of
    four fields in a hot loop, ~36 commands a job in the worker."""

    def __init__(self) -> None:
        self.python = PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)
        self.pack_command = hiredis.pack_command if HIREDIS_AVAILABLE else None

    def pack(self, *args: Any) -> list:
        if self.pack_command is None:
            return self.python.pack(*args)
        name = args[0]
        if b" " in name if type(name) is bytes else " " in name:  # "CLIENT SETNAME": two words on the wire
            args = (*name.split(), *args[1:])
        views = False
        for arg in args:
            kind = type(arg)
            if kind is bytes or kind in _VIEWS:
                if len(arg) > _LARGE:
                    return self.python.pack(*args)
                views = views or kind is not bytes
        if views:  # hiredis takes str, bytes, int and float
            args = tuple(bytes(arg) if type(arg) in _VIEWS else arg for arg in args)
        try:
            return [self.pack_command(args)]
        except TypeError as exc:  # as redis-py reports a value it cannot send
            raise DataError(str(exc)) from exc


_PACKER = _Packer()


async def send_async(client: aioredis.Redis, commands: Sequence[tuple], *, transaction: bool = False) -> list:
    """`commands` on one of `client`'s pooled connections, written at once (as MULTI ... EXEC with
    `transaction`) and their replies read, all under one timeout (the connection's socket timeout): redis-py's
    asyncio Pipeline.execute for a plain list of commands, at about half its CPU (an enqueue's seven commands:
    0.55-0.74 -> 0.25-0.39 ms here). redis-py writes each command batch from a task of its own
    (`asyncio.wait_for`), arms a timeout for each reply and packs in Python; this writes from the caller's
    task and packs with hiredis, as _Packer does.

    Replies come as Redis sends them (no response callbacks: a GET's bytes, an XREAD's nested lists). A
    transaction returns EXEC's replies, and raises the error that made Redis refuse a command (EXEC then
    aborts) or the first error among EXEC's replies; a plain pipeline raises its first error reply once every
    reply is read. A connection error before any reply is read is retried once on a fresh connection, as the
    API's clients retry (a pooled connection a Redis restart left dead); a timeout raises redis's
    TimeoutError, as redis-py's read would."""
    stack = [("MULTI",), *commands, ("EXEC",)] if transaction else list(commands)
    packed: list = []
    for command in stack:
        packed.extend(_PACKER.pack(*command))
    pool = client.connection_pool
    for attempt in (1, 2):
        conn = await pool.get_connection()
        replies: list = []
        first: ResponseError | None = None
        try:
            async with asyncio.timeout(conn.socket_timeout):
                await _write(conn, packed)
                for _ in stack:
                    try:
                        replies.append(await conn.read_response(timeout=math.inf))
                    except ResponseError as exc:  # an error reply: the connection reads on
                        first = first or exc
                        replies.append(exc)
        except RedisConnectionError:  # read_response and _write disconnected it
            if replies or attempt == 2:
                raise
            continue
        except TimeoutError:
            await conn.disconnect()
            raise RedisTimeoutError(f"Timeout talking to Redis at {conn.host}:{conn.port}") from None
        except BaseException:
            await conn.disconnect()  # whatever is left unread goes with it (a cancelled request)
            raise
        finally:
            await pool.release(conn)
        if first is not None:
            raise first
        if not transaction:
            return replies
        for reply in replies[-1] or ():
            if isinstance(reply, Exception):
                raise reply
        return replies[-1] or []
    raise AssertionError("unreachable")


async def _write(conn, packed: list) -> None:
    """The bytes written on the connection's stream from this task; redis-py's send_packed_command when the
    connection has no stream writer of its own (another kind of connection)."""
    writer = getattr(conn, "_writer", None)
    if writer is None or not conn.is_connected:
        await conn.send_packed_command(packed)
        return
    try:
        writer.writelines(packed)
        await writer.drain()
    except OSError as exc:
        await conn.disconnect(nowait=True)
        raise RedisConnectionError(f"Error while writing to Redis at {conn.host}:{conn.port}: {exc}") from exc


class Exchange:
    """`commands` written at once on one of `client`'s pooled connections, their replies then read in parts
    (`read`), each part under a timeout of its own, where send_async reads them all under one: the API's
    enqueue transaction and the blocking read of the job's end, written together, are answered at once and
    when the job ends. Replies are taken straight off the connection's hiredis reader (redis-py's
    read_response per reply costs several times more); an error reply comes back as its exception, as
    send_async's plain pipeline hands it over before raising it. A connection error before any reply is read
    is retried once on a fresh connection (every command written again), as send_async retries one. Used as
    `async with`: a connection left with replies unread (an error, a timeout, a cancelled request) is
    dropped, never pooled."""

    def __init__(self, client: aioredis.Redis, commands: Sequence[tuple]) -> None:
        self._pool = client.connection_pool
        self._packed = [chunk for command in commands for chunk in _PACKER.pack(*command)]
        self._count, self._done, self._retried = len(commands), 0, False
        self._conn = None

    async def __aenter__(self) -> Self:
        await self._open()
        return self

    async def __aexit__(self, kind, exc, tb) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if kind is not None or self._done < self._count:
                await conn.disconnect()
        finally:
            await self._pool.release(conn)

    async def _open(self) -> None:
        conn = await self._pool.get_connection()
        try:
            await _write(conn, self._packed)
        except BaseException:
            await self._pool.release(conn)
            raise
        self._conn = conn

    async def read(self, count: int, timeout_s: float) -> list:
        """The next `count` replies, within timeout_s (past it: redis's TimeoutError, as send_async raises)."""
        try:
            async with asyncio.timeout(timeout_s):
                try:
                    return await self._replies(count)
                except RedisConnectionError:
                    if self._done or self._retried:
                        raise
                    self._retried = True  # a pooled connection a Redis restart left dead: once more, anew
                    await self.__aexit__(RedisConnectionError, None, None)
                    await self._open()
                    return await self._replies(count)
        except TimeoutError:
            conn = self._conn  # None when the retry's connection was still being made
            where = f" at {conn.host}:{conn.port}" if conn is not None else ""
            raise RedisTimeoutError(f"Timeout talking to Redis{where}") from None

    async def _replies(self, count: int) -> list:
        conn, out = self._conn, []
        parser = conn._parser
        reader = getattr(parser, "_reader", None)
        if reader is None or not hasattr(parser, "read_from_socket"):  # redis-py's own parser: its way
            for _ in range(count):
                try:
                    out.append(await conn.read_response(timeout=math.inf))
                except ResponseError as exc:
                    out.append(exc)
                self._done += 1
            return out
        try:
            while len(out) < count:
                reply = reader.gets()
                if reply is NOT_ENOUGH_DATA:
                    await parser.read_from_socket()
                    continue
                out.append(reply)
                self._done += 1
        except OSError as exc:  # a reset: as redis-py's read_response reports it
            await conn.disconnect(nowait=True)
            raise RedisConnectionError(f"Error while reading from Redis at {conn.host}:{conn.port}: {exc}") from exc
        except RedisConnectionError:
            await conn.disconnect(nowait=True)
            raise
        return out
