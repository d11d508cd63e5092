"""The SDK's training runs (gradclient/runs.py) against a recording transport: run.gradients() sends the
request client.gradients() would, with `run: {name, step}`; steps are numbered from `start`, and a call that
raised leaves its number to the next; the run's name is quoted as one path segment. Sync and async alike."""

from __future__ import annotations

import anyio
import httpx
import msgspec
import pytest

from gradclient import AsyncClient, Client
from gradclient.errors import BadOptionError

SPEC = {"layers": [{"type": "Linear", "in_features": 2, "out_features": 1}]}
RESULT = {"device": "cpu", "dtype": "float32", "parameter_count": 3, "torch_version": "", "loss": 0.25,
          "gradients": {}, "timings": {}, "job_id": "job"}
BAD = {"error": {"code": "bad_option", "message": "refused", "detail": {}}}


class Service:
    """Answers POST /gradients 200 (or 422 for the calls listed in `refuse`) and GET /runs/...; records each."""

    def __init__(self, refuse: set[int] = frozenset()) -> None:
        self.posts: list[dict] = []
        self.paths: list[str] = []
        self.refuse = refuse

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.raw_path.decode())
        if request.method == "POST":
            self.posts.append(msgspec.json.decode(request.content))
            if len(self.posts) - 1 in self.refuse:
                return httpx.Response(422, json=BAD)
            return httpx.Response(200, json=RESULT)
        return httpx.Response(200, json={"name": "x", "steps": []})


def _calls(run, service: Service) -> list[dict]:
    """Four calls, the second refused: what each sent as `run`."""
    for i in range(4):
        try:
            run.gradients(SPEC, [[1.0, 2.0]], [[0.5]], loss="mse", numcheck="off")
        except BadOptionError:
            assert i == 1
    return [p["run"] for p in service.posts]


def test_run_numbers_steps_from_start_and_a_refused_call_leaves_its_number_to_the_next():
    service = Service(refuse={1})
    with Client("http://svc", transport=httpx.MockTransport(service), wire_format="json") as client:
        run = client.run("exp 1", start=7)
        sent = _calls(run, service)
        assert run.step == 10
    assert sent == [{"name": "exp 1", "step": s} for s in (7, 8, 8, 9)]
    assert all(p["options"] == {"numcheck": "off", "encoding": "b64"} for p in service.posts)  # no `run` option


def test_async_run_numbers_steps_as_the_sync_one_does():
    service = Service(refuse={1})

    async def main() -> list[dict]:
        async with AsyncClient("http://svc", transport=httpx.MockTransport(service), wire_format="json") as client:
            run = client.run("exp")
            for i in range(4):
                try:
                    await run.gradients(SPEC, [[1.0, 2.0]], [[0.5]], loss="mse", numcheck="off")
                except BadOptionError:
                    assert i == 1
            await run.steps()
        return [p["run"] for p in service.posts]

    assert anyio.run(main) == [{"name": "exp", "step": s} for s in (0, 1, 1, 2)]
    assert service.paths[-1] == "/runs/exp"


@pytest.mark.parametrize("name, path", [("a b&c", "/runs/a%20b%26c"), ("x?y#z", "/runs/x%3Fy%23z")])
def test_a_runs_name_is_one_quoted_path_segment(name, path):
    service = Service()
    with Client("http://svc", transport=httpx.MockTransport(service), wire_format="json") as client:
        client.run(name).steps()
    assert service.paths == [path]
