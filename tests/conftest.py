"""The shared fixtures: one real stack for the session (a private Redis, the API over HTTP, a worker), an
httpx client and an SDK client on it, and a private redis-server per module for the tests that drive the
queue side in this process. A module that needs other settings starts its own with
tests/support/stack.py's start_stack and names why."""

from __future__ import annotations

import httpx
import pytest
import redis

from gradclient import Client
from gradsvc.runtime.launcher import free_port
from tests.support.stack import RedisServer, Stack, start_stack


@pytest.fixture(scope="session")
def stack() -> Stack:
    s = start_stack(workers=1)
    yield s
    s.stop()


@pytest.fixture()
def http(stack: Stack) -> httpx.Client:
    with stack.http_client() as client:
        yield client


@pytest.fixture()
def client(stack: Stack) -> Client:
    with stack.sdk_client() as c:
        yield c


@pytest.fixture(scope="module")
def redis_server() -> RedisServer:
    server = RedisServer(free_port()).start()
    yield server
    server.stop()


@pytest.fixture()
def flushed_redis(redis_server):
    """A client of the module's redis-server, its database emptied first."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()
