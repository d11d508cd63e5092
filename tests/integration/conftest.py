"""Fixtures over a module's live stack: a module that defines `live` (its Stack) gets `http` and `redis`."""

from __future__ import annotations

import pytest


@pytest.fixture()
def http(live):
    with live.http_client() as client:
        yield client


@pytest.fixture()
def redis(live):
    with live.redis_client() as r:
        yield r
