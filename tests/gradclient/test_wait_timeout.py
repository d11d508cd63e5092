"""A wait that runs out tells the caller how to reach the job again, with a method that
exists (`client.gradients` returns no job; `client.job(id)` does)."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from gradclient import Client, Job, WaitTimeoutError
from gradsvc import wire

SPEC = {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}], "dtype": "float64"}


def queued_forever(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/jobs/j-123/cancel":
        return httpx.Response(200, content=msgspec.json.encode(wire.JobInfo(job_id="j-123", status="canceled")),
                              headers={"content-type": "application/json"})
    if request.method == "POST":
        return httpx.Response(202, content=msgspec.json.encode(wire.JobAccepted(job_id="j-123", status="queued")),
                              headers={"content-type": "application/json", "location": "/jobs/j-123"})
    return httpx.Response(200, content=msgspec.json.encode(wire.JobInfo(job_id="j-123", status="queued")),
                          headers={"content-type": "application/json"})


def test_a_wait_timeout_names_client_job_and_the_named_method_works():
    with Client("http://gradsvc.test", retries=0, wire_format="json",
                transport=httpx.MockTransport(queued_forever)) as client:
        with pytest.raises(WaitTimeoutError) as info:
            client.gradients(SPEC, [[1.0, 2.0]], [0], wait_s=0, timeout=0.05)
        message = info.value.message
        assert "client.job('j-123').result()" in message and "client.job('j-123').cancel()" in message
        assert "call result() again" not in message
        assert info.value.job_id == "j-123"
        job = client.job(info.value.job_id)
        assert isinstance(job, Job) and job.status() == "queued" and job.cancel() == "canceled"


def _accepted_after_the_wait(request: httpx.Request) -> float | None:
    """A POST /gradients is answered 202 after its `wait`, as the server holds it; None for the other requests."""
    return float(request.url.params["wait"]) if request.url.path == "/gradients" else None


def test_timeout_bounds_the_whole_call_including_the_servers_wait():
    """timeout=0.3 with wait_s=3 returns after ~0.3 s, not ~3 s: the POST's server-side wait is cut to the timeout."""
    import time

    def handler(request: httpx.Request) -> httpx.Response:
        wait = _accepted_after_the_wait(request)
        if wait is not None:
            time.sleep(wait)
        return queued_forever(request)

    with Client("http://gradsvc.test", retries=0, wire_format="json", transport=httpx.MockTransport(handler)) as client:
        start = time.monotonic()
        with pytest.raises(WaitTimeoutError):
            client.gradients(SPEC, [[1.0, 2.0]], [0], wait_s=3, timeout=0.3)
        assert time.monotonic() - start < 1.5


def test_async_timeout_bounds_the_whole_call_including_the_servers_wait():
    import time

    import anyio

    from gradclient import AsyncClient

    async def handler(request: httpx.Request) -> httpx.Response:
        wait = _accepted_after_the_wait(request)
        if wait is not None:
            await anyio.sleep(wait)
        return queued_forever(request)

    async def main() -> float:
        async with AsyncClient("http://gradsvc.test", retries=0, wire_format="json",
                               transport=httpx.MockTransport(handler)) as client:
            start = time.monotonic()
            with pytest.raises(WaitTimeoutError):
                await client.gradients(SPEC, [[1.0, 2.0]], [0], wait_s=3, timeout=0.3)
            return time.monotonic() - start

    assert anyio.run(main) < 1.5


def test_a_job_is_named_job_id_as_everywhere_else_with_id_as_its_alias():
    """The SDK's Job has `job_id`, as the wire, the errors and the result say (not only `id`)."""
    import anyio

    from gradclient import AsyncClient

    with Client("http://gradsvc.test", retries=0, wire_format="json",
                transport=httpx.MockTransport(queued_forever)) as client:
        job = client.submit(SPEC, [[1.0, 2.0]], [0])
        assert job.job_id == job.id == "j-123" and repr(job) == "Job('j-123')"

    async def main():
        async with AsyncClient("http://gradsvc.test", retries=0, wire_format="json",
                               transport=httpx.MockTransport(queued_forever)) as client:
            job = await client.submit(SPEC, [[1.0, 2.0]], [0])
            assert job.job_id == job.id == "j-123"

    anyio.run(main)
