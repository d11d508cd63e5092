"""The whole path over real HTTP, a real Redis and a real RQ worker."""

from __future__ import annotations

import copy
import time

import pytest
import redis
import torch
import torch.nn.functional as F

from tests.support.nets import SEED_A_LAYERS, from_wire, seed_a_batch, seed_a_module, tensor_json, wide_stack_layers


def seed_a_body(**options) -> dict:
    x, y = seed_a_batch()
    return {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
            "inputs": x.tolist(), "targets": y.tolist(), "loss": "cross_entropy", "options": options}


def test_seed_a_through_the_api_equals_local_autograd(http):
    r = http.post("/gradients", json=seed_a_body(numcheck="exact"))
    assert r.status_code == 200, r.text
    body = r.json()
    x, y = seed_a_batch()
    model = seed_a_module()
    F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(from_wire(body["gradients"][name]), p.grad, rtol=0, atol=1e-12), name
    assert body["status"] == "finished" and body["job_id"]
    assert body["parameter_count"] == 83
    assert body["numcheck"]["evaluations"] == 166
    assert body["numcheck"]["max_rel_error"] < 1e-8
    assert body["numcheck"]["passed"] is True
    assert set(body["timings"]) >= {"queue_ms", "forward_ms", "backward_ms", "numcheck_ms", "total_ms"}
    assert body["memory"]["saved_bytes_total"] == sum(layer["saved_bytes"] for layer in body["memory"]["layers"])


def test_wide_stack_memory_grows_two_mib_per_layer_from_depth_4_to_64(http):
    # Each Linear saves its (batch, width) float32 input: 2048 x 256 x 4 B = 2 MiB, as 512 x 1024 would, with
    # a sixteenth of the parameters to send back (the test reads the memory, not the gradients).
    x = torch.randn(2048, 256)
    totals = {}
    for depth in (4, 8, 16, 32, 64):
        body = {"model": {"layers": wide_stack_layers(depth, width=256), "dtype": "float32"}, "inputs": tensor_json(x),
                "targets": tensor_json(x), "loss": "mse", "options": {"numcheck": "off", "encoding": "b64"}}
        r = http.post("/gradients?wait=120", json=body)
        assert r.status_code == 200, r.text
        memory = r.json()["memory"]
        assert sum(layer["saved_bytes"] for layer in memory["layers"]) == memory["saved_bytes_total"]
        totals[depth] = memory["saved_bytes_total"]
    for a, b in [(4, 8), (8, 16), (16, 32), (32, 64)]:
        assert totals[b] - totals[a] == (b - a) * 2 * 1024 * 1024


def test_wait_zero_answers_202_with_location_then_the_job_finishes(http):
    r = http.post("/gradients?wait=0", json=seed_a_body())
    assert r.status_code == 202
    job_id = r.json()["job_id"]
    assert r.headers["location"] == f"/jobs/{job_id}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        job = http.get(f"/jobs/{job_id}")
        assert job.status_code == 200
        if job.json()["status"] == "finished":
            break
        time.sleep(0.05)
    body = job.json()
    assert body["status"] == "finished"
    assert body["error"] is None
    assert body["result"]["parameter_count"] == 83
    assert body["enqueued_at"] and body["ended_at"]


def test_unknown_job_is_404_with_the_error_body(http):
    r = http.get("/jobs/does-not-exist")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    "mutate, status, code",
    [
        (lambda b: b["model"]["layers"].append({"type": "LSTM"}), 422, "unknown_layer"),
        (lambda b: b["model"]["layers"].__setitem__(2, {"type": "Linear", "in_features": 7, "out_features": 3}),
         422, "shape_mismatch"),
        (lambda b: b["model"].__setitem__("weights", {"0.weight": {"dtype": "float64", "shape": [8, 6],
                                                                   "data": [[0.0] * 6] * 8}}), 422, "bad_weights"),
        (lambda b: b.__setitem__("inputs", {"dtype": "float64", "shape": [4, 6], "data": [[1.0]]}), 422, "bad_tensor"),
        (lambda b: b.__setitem__("inputs", {"dtype": "complex64", "shape": [1], "data": [1]}), 422, "bad_tensor"),
        (lambda b: b.__setitem__("loss", "hinge_of_doom"), 422, "bad_loss"),
        (lambda b: b.__setitem__("targets", [0, 1, 2, 3]), 422, "bad_target"),
        (lambda b: b["model"]["layers"].__setitem__(0, {"type": "Linear", "in_features": 6,
                                                        "out_features": 100_000_000}), 422, "too_large"),
        (lambda b: b.__setitem__("options", {"numchek": "exact"}), 400, "invalid_body"),
    ],
)
def test_invalid_specs_are_refused_before_the_queue(http, stack, mutate, status, code):
    body = seed_a_body()
    mutate(body)
    conn = redis.Redis.from_url(stack.redis.url)
    before = conn.llen("rq:queue:gradsvc")
    submitted = conn.zcard("rq:finished:gradsvc")
    r = http.post("/gradients", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code
    assert len(error["message"]) > 20
    assert conn.llen("rq:queue:gradsvc") == before
    assert conn.zcard("rq:finished:gradsvc") == submitted


def test_malformed_json_is_400(http):
    r = http.post("/gradients", content=b'{"model": {"layers": [}', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "malformed_body"


def test_layers_health_and_schema(http):
    layers = http.get("/layers").json()
    linear = next(entry for entry in layers if entry["type"] == "Linear")
    assert {k: linear[k] for k in ("arguments", "required", "container")} == {
        "arguments": {"in_features": "int >= 1", "out_features": "int >= 1", "bias": "bool"},
        "required": ["in_features", "out_features"], "container": False}
    assert linear["details"]["bias"] == {"kind": "bool", "required": False, "default": True, "range": ""}
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json()["workers"] >= 1
    schema = http.get("/schema").json()
    assert schema["openapi"].startswith("3.")
    assert "GradientRequest" in schema["components"]["schemas"]
