"""A private redis-server per test module for the worker-side tests."""

from __future__ import annotations

import pytest

from gradsvc.runtime.launcher import free_port

from ..stack import RedisServer


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer(free_port()).start()
    yield server
    server.stop()
