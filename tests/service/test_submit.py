"""POST /gradients before the queue: what the API refuses without touching Redis (its Redis here is dead,
so anything that reached the queue would answer 503)."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from gradsvc.runtime.settings import Settings
from service.app import create_app

from tests.support.stack import dead_redis_url

BATCH_NORM_NET = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "BatchNorm1d", "num_features": 8},
                  {"type": "Tanh"}, {"type": "Linear", "in_features": 8, "out_features": 3}]


@pytest.fixture(scope="module")
def api() -> TestClient:
    settings = Settings(redis_url=dead_redis_url(), redis_timeout_s=1)
    with TestClient(create_app(settings)) as client:
        yield client


def body(layers=BATCH_NORM_NET, **options) -> dict:
    return {"model": {"layers": layers, "dtype": "float32"}, "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]] * 4,
            "targets": [0, 1, 2, 0], "options": options}


@pytest.mark.parametrize("options, option", [({"micro_batch": 1}, "micro_batch"), ({"micro_batch": 2}, "micro_batch"),
                                             ({"per_sample": "norms"}, "per_sample")])
def test_batch_norm_with_a_split_batch_is_a_422_bad_option_naming_the_layer_before_the_queue(api, options, option):
    r = api.post("/gradients", json=body(**options))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_option" and error["detail"] == {"layer": "1", "option": option}
    assert "layer 1 (BatchNorm1d)" in error["message"] and option in error["message"]


def test_the_same_request_without_the_split_reaches_the_queue(api):
    r = api.post("/gradients", json=body())
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_unavailable"


@pytest.mark.parametrize("shards", [0, 300, -1])
def test_shards_outside_1_to_256_is_a_400_invalid_body_as_the_schema_declares(api, shards):
    """The range is the schema's (400 invalid_body, declared in GET /schema), not the engine's 422 bad_option."""
    linear = [{"type": "Linear", "in_features": 6, "out_features": 3}]
    r = api.post("/gradients", json=body(layers=linear, shards=shards))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_body" and "options.shards" in error["message"]
    assert error["detail"]["path"] == "$.options.shards"
    declared = api.get("/schema").json()["components"]["schemas"]["Options"]["properties"]["shards"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": 256} in declared and {"enum": ["auto"]} in declared


@pytest.mark.parametrize("where, seed", [("model.seed", 1 << 64), ("model.seed", -(1 << 63) - 1),
                                         ("options.hvp.seed", 1 << 64)])
def test_a_seed_outside_64_bits_is_a_422_bad_option_before_the_queue(api, where, seed):
    linear = [{"type": "Linear", "in_features": 6, "out_features": 3}]
    sent = body(layers=linear)
    if where == "model.seed":
        sent["model"]["seed"] = seed
    else:
        sent["options"]["hvp"] = {"vector": "random", "seed": seed}
    r = api.post("/gradients", json=sent)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_option" and error["detail"]["option"] == where and where in error["message"]


def test_a_malformed_idempotency_key_is_a_400_naming_the_header_before_the_body_is_read(api):
    """The headers are checked before the body, so a bad key is named even when the body is not valid JSON."""
    r = api.post("/gradients", content=b"{not json", headers={"Content-Type": "application/json",
                                                               "Idempotency-Key": "k" * 256})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_request" and error["detail"] == {"header": "Idempotency-Key"}


def test_the_idempotency_digest_threads_are_made_by_the_app_and_shut_down_with_it():
    app = create_app(Settings(redis_url=dead_redis_url(), redis_timeout_s=1))
    digests = app.state.submitter.enqueuer.digests
    with TestClient(app):
        assert digests.submit(len, b"body").result() == 4
    with pytest.raises(RuntimeError, match="shutdown"):
        digests.submit(len, b"body")
    assert create_app(Settings(redis_url=dead_redis_url())).state.submitter.enqueuer.digests is not digests
