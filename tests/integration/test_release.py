"""Results released by their owner (Gradsvc-Release-Results), over real HTTP, Redis and a worker, with large
results handed off as files: the SDK releases each large result gradients() returned with its next POST, so a
training loop's results do not pile up for GRADSVC_RESULT_TTL_S; another key's release drops nothing and
tells it nothing; a malformed header is a coded 400."""

from __future__ import annotations

import httpx
import pytest
import torch
from torch import nn

from gradclient import Client

from tests.support.stack import Stack, start_stack

KEYS = ("release-a-0123456789", "release-b-0123456789")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack() -> Stack:
    s = start_stack(workers=1, handoff=True, GRADSVC_API_KEYS=",".join(KEYS))
    yield s
    s.stop()


def http(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def step(client: Client, model: nn.Module) -> str:
    torch.manual_seed(0)
    return client.gradients(model, torch.randn(4, 600), torch.tensor([0, 1, 2, 3]), numcheck="off",
                            memory=False).job_id


def released_total(stack: Stack) -> float:
    text = http(stack, KEYS[0]).get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("gradsvc_results_released_total "))


def test_the_sdk_releases_a_large_result_with_its_next_call_and_keeps_small_ones(stack):
    wide = nn.Linear(600, 600)  # 1.4 MB of gradients: a result over 1 MiB, handed off as a file
    before = released_total(stack)
    with Client(stack.base_url, api_key=KEYS[0]) as client:
        first, second = step(client, wide), step(client, wide)
        small = step(client, nn.Linear(600, 4))
        third = step(client, nn.Linear(600, 4))
    with http(stack, KEYS[0]) as c:
        gone = c.get(f"/jobs/{first}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found", gone.text
        assert "released" in gone.json()["error"]["message"]
        # The second went with the small call after it; that small result and the last are kept.
        assert c.get(f"/jobs/{second}").status_code == 404
        for job_id in (small, third):
            r = c.get(f"/jobs/{job_id}")
            assert r.status_code == 200 and r.json()["status"] == "finished", r.text
    files = {p.name for p in stack.handoff_dir.iterdir()}
    assert f"{first}.out" not in files and f"{second}.out" not in files, files
    # A released file's pages went to the API's spare for the next body (Handoff.recycle): nothing piles up,
    # at most the API's spare and the worker's are left.
    assert len([name for name in files if name.startswith(".spare-")]) <= 2, files
    assert released_total(stack) - before == 2


def test_release_results_false_keeps_every_result(stack):
    wide = nn.Linear(600, 600)
    with Client(stack.base_url, api_key=KEYS[0], release_results=False) as client:
        first, second = step(client, wide), step(client, wide)
    with http(stack, KEYS[0]) as c:
        for job_id in (first, second):
            r = c.get(f"/jobs/{job_id}")
            assert r.status_code == 200 and r.json()["result"]["gradients"], r.text
    assert f"{first}.out" in {p.name for p in stack.handoff_dir.iterdir()}


def test_another_key_cannot_release_a_result_and_learns_nothing(stack):
    with Client(stack.base_url, api_key=KEYS[0], release_results=False) as client:
        theirs = step(client, nn.Linear(600, 600))
    body = {"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}]},
            "inputs": [[1.0, 2.0]], "targets": [1], "options": {"numcheck": "off"}}
    never = "00000000-0000-4000-8000-000000000000"
    with http(stack, KEYS[1]) as other:
        answers = [other.post("/gradients", json=body, headers={"Gradsvc-Release-Results": job_id})
                   for job_id in (theirs, never)]
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    with http(stack, KEYS[0]) as c:
        assert c.get(f"/jobs/{theirs}").status_code == 200
    assert f"{theirs}.out" in {p.name for p in stack.handoff_dir.iterdir()}


@pytest.mark.parametrize("header", ["not-a-job", ",".join(["00000000-0000-4000-8000-000000000000"] * 17)])
def test_a_malformed_release_header_is_a_coded_400(stack, header):
    with http(stack, KEYS[0]) as c:
        # 17 copies of one id: the limit counts what is listed.
        r = c.post("/gradients", json={"model": {"layers": []}, "inputs": [[1.0]]},
                   headers={"Gradsvc-Release-Results": header})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_request" and error["detail"]["header"] == "Gradsvc-Release-Results", error
