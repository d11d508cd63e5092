"""gradsvc/broker/connection.py's command packer and send_async, and job.py's serializer. The packer writes
what redis-py's own packers write, byte for byte, sends a large value without copying it, refuses what
redis-py refuses; a real Redis (a private redis-server) reads back what it was sent. send_async answers as
Redis does, raises its errors, retries a dead pooled connection once, times out and drops a connection left
mid-reply. Exchange writes commands at once and reads their replies in parts, each part under its own
timeout, with the same retry and the same care not to pool a connection left mid-reply. The serializer is what
RQ takes."""

from __future__ import annotations

import pytest
from redis.connection import Encoder, HiredisRespSerializer, PythonRespSerializer
from redis.exceptions import DataError
from rq import Queue
from rq.serializers import Serializer, resolve_serializer

from gradsvc.broker.connection import _LARGE, _Packer, sync_redis
from gradsvc.broker.job import MsgpackSerializer

COMMANDS = [
    ("SET", "k", "v"),
    ("HSET", "gradsvc:rq:job:8f0a", "status", "finished", "ended_at", "2026-12-02T02:00:00.123456Z"),
    ("EXPIRE", "k", 600),
    ("ZADD", "z", 1.5, "m", -2, "n"),
    ("SET", b"k", b"\x00\xffbytes"),
    ("SET", "k", bytearray(b"array")),
    ("SET", "k", memoryview(b"view")),
    ("SET", "k", memoryview(b"x" * 100)[10:20]),
    ("SET", "k", ""),
    ("SET", "k", "unicod\u00e9 \u2603"),
    ("CLIENT SETNAME", "name"),  # a two-word command name goes as two words
    (b"CLIENT SETNAME", b"name"),
    ("SET", "k", b"x" * _LARGE),  # the largest value hiredis packs
]


def _wire(chunks: list) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def _command_id(args) -> str:
    """The same id in every process (a memoryview's repr names its address; xdist compares the ids)."""
    return repr(tuple(f"memoryview({bytes(a)!r})" if isinstance(a, memoryview) else a for a in args))[:40]


@pytest.mark.parametrize("args", COMMANDS, ids=_command_id)
def test_it_packs_what_redis_py_packs(args):
    python = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    assert _wire(_Packer().pack(*args)) == _wire(HiredisRespSerializer().pack(*args)) == _wire(python.pack(*args))


@pytest.mark.parametrize("large", [bytes(_LARGE + 1), bytearray(_LARGE + 1), memoryview(bytes(3 * _LARGE))])
def test_a_large_value_is_sent_as_it_is(large):
    chunks = _Packer().pack("SET", "k", large)
    assert any(c is large for c in chunks), "the value itself is one of the pieces sent, not a copy"
    python = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    assert _wire(chunks) == _wire(python.pack("SET", "k", large))


@pytest.mark.parametrize("value", [None, object(), ["a"]])
def test_a_value_redis_cannot_take_is_a_data_error(value):
    with pytest.raises(DataError):
        _Packer().pack("SET", "k", value)


def test_redis_reads_back_what_was_sent(redis_server):
    r = sync_redis(redis_server.url)
    try:
        big = bytes(range(256)) * (3 * _LARGE // 256)
        values = {"s": "unicod\u00e9", "b": b"\x00\xff", "a": bytearray(b"arr"), "m": memoryview(b"xview")[1:],
                  "i": 42, "f": 1.25, "big": memoryview(big)}
        with r.pipeline() as pipe:
            for k, v in values.items():
                pipe.set(k, v)
            pipe.hset("h", mapping={"x": 1, "y": b"2"})
            pipe.execute()
        assert r.mget(list(values)) == [b"unicod\xc3\xa9", b"\x00\xff", b"arr", b"view", b"42", b"1.25", big]
        assert r.hgetall("h") == {b"x": b"1", b"y": b"2"}
    finally:
        r.flushdb()
        r.close()


def test_the_serializer_is_one_rq_takes_by_object_and_by_path():
    assert isinstance(MsgpackSerializer, Serializer)
    assert resolve_serializer(MsgpackSerializer) is MsgpackSerializer
    assert resolve_serializer("gradsvc.broker.job.MsgpackSerializer") is MsgpackSerializer
    assert MsgpackSerializer.loads(MsgpackSerializer.dumps({"a": [1, b"x"]})) == {"a": [1, b"x"]}
    assert Queue("q", connection=sync_redis("redis://127.0.0.1:1/0"), serializer=MsgpackSerializer).serializer \
        is MsgpackSerializer


# --- send_async: the API's hot round trips ----------------------------------------------------------------

def _async_client(url: str, timeout_s: float = 5.0):
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                             retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))


def _run(coro):
    import asyncio

    return asyncio.run(coro)


def test_send_async_answers_as_redis_does(redis_server):
    from gradsvc.broker.connection import send_async

    async def go():
        r = _async_client(redis_server.url)
        try:
            await r.flushdb()
            exec_replies = await send_async(r, [("SET", "a", memoryview(b"xy")), ("INCR", "n"), ("HSET", "h", "f", 1.5),
                                                ("XADD", "s", "*", "k", "v"), ("GET", "a")], transaction=True)
            assert exec_replies[1:3] == [1, 1] and exec_replies[4] == b"xy"
            got, raw = await send_async(r, [("XREAD", "COUNT", 1, "BLOCK", 10, "STREAMS", "s", "0-0"), ("GET", "a")])
            entries = got[b"s"] if isinstance(got, dict) else dict(got)[b"s"]  # RESP3's map, RESP2's pairs
            assert entries[0][1] == [b"k", b"v"] and raw == b"xy"
            nothing, missing = await send_async(r, [("XREAD", "COUNT", 1, "BLOCK", 10, "STREAMS", "none", "0-0"),
                                                    ("GET", "none")])
            assert nothing is None and missing is None  # what the API's wait reads as "not ended yet"
            assert await r.hget("h", "f") == b"1.5"
        finally:
            await r.flushdb()
            await r.aclose()

    _run(go())


def test_send_async_raises_redis_errors_and_the_connection_reads_on(redis_server):
    from redis.exceptions import ResponseError

    from gradsvc.broker.connection import send_async

    async def go():
        r = _async_client(redis_server.url)
        try:
            await r.set("str", "text")
            with pytest.raises(ResponseError, match="not an integer"):  # at EXEC: the others ran
                await send_async(r, [("SET", "x", 1), ("INCR", "str")], transaction=True)
            assert await r.get("x") == b"1"
            with pytest.raises(ResponseError, match="wrong number of arguments"):  # refused: nothing ran
                await send_async(r, [("SET", "y", 1), ("GET",)], transaction=True)
            assert await r.get("y") is None
            with pytest.raises(ResponseError, match="not an integer"):
                await send_async(r, [("INCR", "str"), ("SET", "z", 2)])
            assert await r.get("z") == b"2"
            assert await send_async(r, [("GET", "x")]) == [b"1"]  # the pooled connection is in step
            assert len(r.connection_pool._available_connections) == 1
        finally:
            await r.flushdb()
            await r.aclose()

    _run(go())


def test_send_async_retries_once_on_a_connection_a_restart_left_dead():
    from redis.exceptions import ConnectionError as RedisConnectionError

    from gradsvc.broker.connection import send_async
    from tests.support.stack import RedisServer, free_port

    port = free_port()
    server = RedisServer(port).start()

    async def go():
        r = _async_client(server.url, timeout_s=2)
        try:
            assert await send_async(r, [("SET", "k", "v")]) == [b"OK"]  # a connection in the pool
            server.stop()
            RedisServer(port, proc=None).start()  # another server on the same port: the pooled connection is dead
            assert await send_async(r, [("SET", "k", "w"), ("GET", "k")], transaction=True) == [b"OK", b"w"]
        finally:
            await r.aclose()
        dead = _async_client("redis://127.0.0.1:1/0", timeout_s=1)
        try:
            with pytest.raises(RedisConnectionError):
                await send_async(dead, [("GET", "k")])
        finally:
            await dead.aclose()

    try:
        _run(go())
    finally:
        import subprocess
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True)


def test_send_async_times_out_as_redis_py_does_and_drops_the_connection(redis_server):
    import asyncio

    from redis.exceptions import TimeoutError as RedisTimeoutError

    from gradsvc.broker.connection import send_async

    async def go():
        r = _async_client(redis_server.url, timeout_s=0.3)
        try:
            with pytest.raises(RedisTimeoutError):
                await send_async(r, [("BLPOP", "never", 2)])
            task = asyncio.ensure_future(send_async(r, [("BLPOP", "never", 0.2)]))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # neither connection went back to the pool with a reply still to come
            assert all(not c.is_connected for c in r.connection_pool._available_connections)
            assert await send_async(r, [("PING",)]) == [b"PONG"]
        finally:
            await r.aclose()

    _run(go())


def test_each_way_redis_refuses_writes_is_told_apart_and_other_errors_are_not_refusals(redis_server):
    """On a real Redis: at maxmemory (in a pipeline too, where redis-py rewrites the message), with too few
    replicas; and the plain replies a refusal is not."""
    from redis.exceptions import ResponseError

    from gradsvc.broker.connection import refusal

    r = sync_redis(redis_server.url)
    caught = {}
    try:
        r.config_set("maxmemory", 1)
        for what, call in (("set", lambda: r.set("k", "v")), ("pipeline", lambda: r.pipeline().set("k", "v").execute())):
            with pytest.raises(ResponseError) as exc:
                call()
            caught[what] = refusal(exc.value)
        r.config_set("maxmemory", 0)
        r.config_set("min-replicas-to-write", 1)
        with pytest.raises(ResponseError) as exc:
            r.set("k", "v")
        caught["noreplicas"] = refusal(exc.value)
    finally:
        r.config_set("maxmemory", 0)
        r.config_set("min-replicas-to-write", 0)
    assert caught == {"set": "redis_oom", "pipeline": "redis_oom", "noreplicas": "redis_unavailable"}
    with pytest.raises(ResponseError) as wrong_type:
        r.set("s", "v")
        r.lpush("s", "x")
    assert refusal(wrong_type.value) is None
    assert refusal(ResponseError("MISCONF Redis is configured to save RDB snapshots, but ...")) == "redis_unavailable"
    assert refusal(ResponseError("UNBLOCKED force unblock from blocking operation")) == "redis_unavailable"
    assert refusal(ConnectionError("down")) is None


# --- Exchange: a transaction and a blocking read written together, read in two parts -----------------------

def test_an_exchange_reads_a_transaction_at_once_and_a_blocking_read_when_it_is_answered(redis_server):
    import asyncio

    from redis.exceptions import ResponseError

    from gradsvc.broker.connection import Exchange

    async def go():
        r, other = _async_client(redis_server.url), _async_client(redis_server.url)
        try:
            await r.flushdb()
            await r.set("str", "text")
            commands = [("MULTI",), ("SET", "a", b"xy"), ("INCR", "str"), ("EXEC",),
                        ("XREAD", "COUNT", 1, "BLOCK", 2000, "STREAMS", "s", "0-0"), ("GET", "a")]
            async with Exchange(r, commands) as exchange:
                multi, queued, _, replies = await exchange.read(4, 1.0)  # before the stream has an entry
                assert multi == b"OK" and queued == b"QUEUED"
                assert replies[0] == b"OK" and isinstance(replies[1], ResponseError)  # failed inside EXEC: handed over
                await asyncio.sleep(0.05)
                await other.xadd("s", {"k": "v"})
                got, raw = await exchange.read(2, 2.0)
            entries = got[b"s"] if isinstance(got, dict) else dict(got)[b"s"]  # RESP3's map, RESP2's pairs
            assert entries[0][1] == [b"k", b"v"] and raw == b"xy"
            assert len(r.connection_pool._available_connections) == 1  # read to its end: pooled
            assert await send_async_get(r, "a") == b"xy"
        finally:
            await r.flushdb()
            await r.aclose()
            await other.aclose()

    _run(go())


async def send_async_get(r, key):
    from gradsvc.broker.connection import send_async

    return (await send_async(r, [("GET", key)]))[0]


def test_an_exchange_left_mid_reply_drops_its_connection_and_times_out_as_redis_py_does(redis_server):
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from gradsvc.broker.connection import Exchange

    async def go():
        r = _async_client(redis_server.url)
        try:
            async with Exchange(r, [("PING",), ("BLPOP", "never", 2)]) as exchange:
                assert await exchange.read(1, 1.0) == [b"PONG"]
            # the BLPOP was never read: its connection is not pooled with a reply still to come
            assert all(not c.is_connected for c in r.connection_pool._available_connections)
            with pytest.raises(RedisTimeoutError):
                async with Exchange(r, [("BLPOP", "never", 2)]) as exchange:
                    await exchange.read(1, 0.2)
            assert all(not c.is_connected for c in r.connection_pool._available_connections)
            assert await send_async_get(r, "none") is None
        finally:
            await r.aclose()

    _run(go())


def test_an_exchange_retries_once_on_a_connection_a_restart_left_dead():
    from redis.exceptions import ConnectionError as RedisConnectionError

    from gradsvc.broker.connection import Exchange
    from tests.support.stack import RedisServer, free_port

    port = free_port()
    server = RedisServer(port).start()

    async def go():
        r = _async_client(server.url, timeout_s=2)
        try:
            assert await send_async_get(r, "k") is None  # a connection in the pool
            server.stop()
            RedisServer(port, proc=None).start()  # another server on the same port: the pooled connection is dead
            async with Exchange(r, [("SET", "k", "w"), ("GET", "k")]) as exchange:
                assert await exchange.read(2, 2.0) == [b"OK", b"w"]
        finally:
            await r.aclose()
        dead = _async_client("redis://127.0.0.1:1/0", timeout_s=1)
        try:
            with pytest.raises(RedisConnectionError):
                async with Exchange(dead, [("GET", "k")]) as exchange:
                    await exchange.read(1, 1.0)
        finally:
            await dead.aclose()

    try:
        _run(go())
    finally:
        import subprocess
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True, check=False)
