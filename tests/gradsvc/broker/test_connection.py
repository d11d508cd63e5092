"""gradsvc/broker/connection.py's command packer and job.py's serializer: the packer writes what redis-py's
own packers write, byte for byte, sends a large value without copying it, refuses what redis-py refuses;
a real Redis (a private redis-server) reads back what it was sent. The serializer is what RQ takes."""

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


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: repr(a)[:40])
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

