"""Shared fixtures: a real stack (private Redis, API over HTTP, a worker) for integration tests."""

from __future__ import annotations

import httpx
import pytest

from .stack import Stack, start_stack


@pytest.fixture(scope="session")
def stack() -> Stack:
    s = start_stack(workers=1)
    yield s
    s.stop()


@pytest.fixture()
def http(stack: Stack) -> httpx.Client:
    with httpx.Client(base_url=stack.base_url, timeout=120, headers=stack.auth_headers()) as client:
        yield client
