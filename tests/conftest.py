"""Shared fixtures: a real stack (private Redis, API over HTTP, a worker) for integration tests, and a
private redis-server per module for the tests that drive the queue side in this process."""

from __future__ import annotations

import httpx
import pytest

from gradsvc.runtime.launcher import free_port
from tests.support.stack import RedisServer, Stack, start_stack


@pytest.fixture(scope="session")
def stack() -> Stack:
    s = start_stack(workers=1)
    yield s
    s.stop()


@pytest.fixture()
def http(stack: Stack) -> httpx.Client:
    with httpx.Client(base_url=stack.base_url, timeout=120, headers=stack.auth_headers()) as client:
        yield client


@pytest.fixture(scope="module")
def redis_server() -> RedisServer:
    server = RedisServer(free_port()).start()
    yield server
    server.stop()
