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


@pytest.mark.parametrize("route", ["/gradients", "/estimate"])
@pytest.mark.parametrize("where, seed", [("model.seed", 1 << 64), ("model.seed", -(1 << 63) - 1),
                                         ("options.hvp.seed", 1 << 64), ("options.curvature.seed", 1 << 64),
                                         ("options.curvature.seed", 1 << 80),
                                         ("options.curvature.seed", -(1 << 63) - 1)])
def test_a_seed_outside_64_bits_is_a_422_bad_option_before_the_queue(api, route, where, seed):
    linear = [{"type": "Linear", "in_features": 6, "out_features": 3}]
    sent = body(layers=linear)
    if where == "model.seed":
        sent["model"]["seed"] = seed
    elif where == "options.hvp.seed":
        sent["options"]["hvp"] = {"vector": "random", "seed": seed}
    else:
        sent["options"]["curvature"] = {"top": 1, "seed": seed}
    r = api.post(route, json=sent)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_option" and error["detail"]["option"] == where and where in error["message"]
    assert str(-(1 << 63)) in error["message"] and str((1 << 64) - 1) in error["message"]


def test_every_seed_field_of_the_request_is_in_the_one_seed_validator():
    """A seed field added to the wire later is found here, so it cannot reach the worker unchecked."""
    import msgspec

    from gradsvc.wire import GradientRequest
    from service.parsing import SEED_FIELDS

    def walk(tp, path):
        for arg in getattr(tp, "__args__", ()) or ():
            yield from walk(arg, path)
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            for f in msgspec.structs.fields(tp):
                if f.name == "seed":
                    yield f"{path}.seed".lstrip(".")
                elif f.name in ("model", "options", "hvp", "curvature", "clip", "run"):
                    yield from walk(f.type, f"{path}.{f.name}")

    assert sorted(set(walk(GradientRequest, ""))) == sorted(SEED_FIELDS)


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
