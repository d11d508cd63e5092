"""SDK clients on the shared test stack (tests/conftest.py's `stack`)."""

from __future__ import annotations

import pytest

from gradclient import Client


@pytest.fixture()
def client(stack):
    key = stack.env.get("GRADSVC_API_KEYS", "").split(",")[0] or None
    with Client(stack.base_url, api_key=key, timeout=120) as c:
        yield c
