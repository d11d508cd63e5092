"""The rule: every error the API answers names what is wrong, where (field path or parameter), the
limit or the valid values, and the fix; no Python reprs, no framework stock texts. Framework errors (size
limit, query parameters, methods, media types, unknown routes) go through the same renderer.

The Litestar TestClient runs the real app; Redis is a dead address, since every answer here comes before
the queue (that is the point of item 1)."""

from __future__ import annotations

import copy
import json

import pytest
from litestar.testing import TestClient
from msgspec import inspect as mi

from gradsvc.runtime.settings import Settings
from gradsvc.wire import Options
from service.app import create_app

from tests.support.nets import SEED_A_LAYERS
from tests.support.stack import dead_redis_url

STOCK_PHRASES = ("Request Entity Too Large", "Method Not Allowed", "Not Found", "Validation failed", "Bad Request",
                 "Unsupported Media Type", "Internal Server Error", "Invalid enum value", "Object contains",
                 "Traceback")
JSON_HEADERS = {"Content-Type": "application/json"}
MAX_BODY = 4096


def body(**extra) -> dict:
    out = {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
           "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
           "options": {"numcheck": "off"}}
    for key, value in extra.items():
        if key == "options":
            out["options"].update(value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def client():
    app = create_app(Settings(redis_url=dead_redis_url(), max_body_bytes=MAX_BODY, redis_timeout_s=0.2))
    with TestClient(app) as c:
        yield c


def error_of(response) -> dict:
    payload = response.json()
    assert set(payload) >= {"error"}, payload
    err = payload["error"]
    assert set(err) == {"code", "message", "detail"}, err
    message = err["message"]
    assert "<" not in message and "'{" not in message, message  # no Python reprs
    for phrase in STOCK_PHRASES:
        assert phrase not in message, (phrase, message)
    return err


def post(client, payload, *, path="/gradients?wait=0", headers=JSON_HEADERS, raw: bytes | None = None):
    return client.post(path, content=raw if raw is not None else json.dumps(payload).encode(), headers=headers)


# item 2
def test_an_over_size_body_names_the_limit_the_setting_and_the_ways_out(client):
    r = post(client, None, raw=b"[" + b"0.123456789," * 1000 + b"0]")
    err = error_of(r)
    assert r.status_code == 413 and err["code"] == "body_too_large"
    for part in (str(MAX_BODY), "GRADSVC_MAX_BODY_BYTES", "application/msgpack", "b64", "split the batch"):
        assert part in err["message"], part
    assert err["detail"]["limit_bytes"] == MAX_BODY


# item 3
@pytest.mark.parametrize("value", ["abc", "-1", "nan", "null", "", "inf"])
def test_a_bad_wait_is_a_query_parameter_error_naming_wait_and_its_range(client, value):
    r = post(client, body(), path=f"/gradients?wait={value}")
    err = error_of(r)
    assert r.status_code == 400 and err["code"] == "invalid_parameter"
    assert "query parameter `wait`" in err["message"] and repr(value) in err["message"]
    assert "wait=0" in err["message"] and "GRADSVC_MAX_WAIT_S" in err["message"]
    assert err["detail"]["parameter"] == "wait"


def enum_options() -> list[tuple[str, tuple]]:
    info = mi.type_info(Options)
    return [(f.encode_name, f.type.values) for f in info.fields if isinstance(f.type, mi.LiteralType)]


def test_every_enum_option_is_walked():
    assert {name for name, _ in enum_options()} >= {"numcheck", "device", "per_sample", "encoding"}


def test_wait_given_twice_is_refused_not_the_last_one_taken(client):
    err = error_of(post(client, body(), path="/gradients?wait=0&wait=5"))
    assert err["code"] == "invalid_parameter" and "wait=0&wait=5" in err["message"]


# item 4
@pytest.mark.parametrize("option,valid", enum_options(), ids=[n for n, _ in enum_options()])
def test_an_unknown_enum_value_lists_the_valid_values(client, option, valid):
    r = post(client, body(options={option: "full-ish"}))
    err = error_of(r)
    assert r.status_code == 400 and err["code"] == "invalid_body"
    assert f"options.{option}" in err["message"] and "'full-ish'" in err["message"]
    for value in valid:
        assert repr(value) in err["message"], value
    assert sorted(err["detail"]["valid"]) == sorted(valid)


# item 5, through the API
def test_float_class_labels_say_class_indices_must_be_integers(client):
    targets = {"dtype": "float32", "shape": [2], "data": [0.0, 2.0]}
    r = post(client, body(targets=targets))
    err = error_of(r)
    assert r.status_code == 422 and err["code"] == "bad_target"
    assert "class indices must be integers" in err["message"] and "int64" in err["message"]


# item 6
def test_top_level_weights_point_to_model_weights(client):
    r = post(client, body(weights={"0.weight": [[0.0] * 6] * 8}))
    err = error_of(r)
    assert r.status_code == 400 and err["code"] == "invalid_body"
    assert "unknown field `weights`" in err["message"] and "`model.weights`" in err["message"]
    assert err["detail"]["belongs_in"] == "model.weights"


def test_an_unknown_field_names_where_and_what_is_accepted(client):
    r = post(client, body(options={"numchek": "exact"}))
    err = error_of(r)
    assert r.status_code == 400 and err["code"] == "invalid_body"
    assert "options: unknown field `numchek`" in err["message"] and "did you mean `numcheck`" in err["message"]
    assert "micro_batch" in err["message"]  # the fields options takes
    assert err["detail"]["path"] == "$.options"


def test_a_missing_required_field_is_named(client):
    r = post(client, {"model": {"layers": SEED_A_LAYERS}})
    err = error_of(r)
    assert r.status_code == 400 and "required field `inputs`" in err["message"]


def test_a_wrong_media_type_is_415_with_the_accepted_types(client):
    r = post(client, body(), headers={"Content-Type": "text/plain"})
    err = error_of(r)
    assert r.status_code == 415 and err["code"] == "unsupported_media_type"
    assert "'text/plain'" in err["message"] and "Content-Type: application/json" in err["message"]
    assert "application/msgpack" in err["message"]


@pytest.mark.parametrize("method,path,allowed", [("PUT", "/gradients", "POST"), ("GET", "/gradients", "POST"),
                                                 ("POST", "/layers", "GET"), ("PATCH", "/jobs/abc", "GET"),
                                                 ("DELETE", "/jobs/abc", "GET")])
def test_a_wrong_method_is_405_with_allow_and_the_accepted_methods(client, method, path, allowed):
    r = client.request(method, path)
    err = error_of(r)
    assert r.status_code == 405 and err["code"] == "method_not_allowed"
    assert set(r.headers["allow"].split(", ")) - {"OPTIONS"} == set(allowed.split(", "))
    assert f"{method} is not allowed on {path}" in err["message"]
    for m in allowed.split(", "):
        assert m in err["message"]


def test_options_lists_the_methods_of_a_job_and_of_its_cancel(client):
    r = client.options("/jobs/abc")
    assert r.status_code == 204 and set(r.headers["allow"].split(", ")) == {"GET", "OPTIONS"}
    assert set(client.options("/jobs/abc/cancel").headers["allow"].split(", ")) == {"POST", "OPTIONS"}


def test_a_delete_of_a_job_is_a_405_that_names_the_cancels_route(client):
    err = error_of(client.delete("/jobs/abc"))
    assert err["code"] == "method_not_allowed" and "POST /jobs/{id}/cancel" in err["message"]


def test_an_unknown_route_lists_the_routes(client):
    r = client.get("/gradient")
    err = error_of(r)
    assert r.status_code == 404 and "POST /gradients" in err["message"] and "GET /layers" in err["message"]


# item 1: refused before the queue, even with wait=0 (the old answer was 202 and a job that failed later)
def test_per_sample_with_batch_norm_is_422_not_a_queued_job(client):
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "BatchNorm1d", "num_features": 8},
              {"type": "Linear", "in_features": 8, "out_features": 3}]
    payload = body(options={"per_sample": "norms"})
    payload["model"]["layers"] = layers
    r = post(client, payload)
    err = error_of(r)
    assert r.status_code == 422 and err["code"] == "bad_option" and "BatchNorm1d" in err["message"]


def test_empty_layers_are_refused_by_the_schema_not_as_an_unknown_layer(client):
    payload = body()
    payload["model"]["layers"] = []
    r = post(client, payload)
    err = error_of(r)
    assert r.status_code == 400 and err["code"] == "invalid_body"
    assert "model.layers" in err["message"] and "empty" in err["message"]


def test_integer_options_written_as_integral_floats_are_integers_as_json_schema_says(client):
    payload = body(options={"timing_repeat": 2.0, "micro_batch": 1.0})
    payload["model"]["layers"] = [{"type": "Linear", "in_features": 6, "out_features": 3}]
    payload["model"]["layers"][0]["in_features"] = 6
    r = post(client, payload)
    assert r.status_code == 503, r.text  # decoded and validated; only the dead queue stops it
    r = post(client, body(options={"timing_repeat": 2.5}))
    err = error_of(r)
    assert r.status_code == 400 and "options.timing_repeat: expected int, got float" in err["message"]


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_integral_floats_are_queued_as_ints_so_the_worker_decodes_what_the_api_validated(fmt):
    """The API took `micro_batch: 1.0` but queued the original bytes, which the worker's strict
    decode refused (a traceback, then a failed job); the queued body now carries the ints."""
    import msgspec

    from service.parsing import _decode
    from workers.jobs import decode_request

    payload = body(options={"timing_repeat": 2.0, "micro_batch": 1.0, "shards": 2.0})
    payload["model"]["seed"] = 1.0
    codec = msgspec.json if fmt == "json" else msgspec.msgpack
    req, queued = _decode(codec.encode(payload), fmt)
    worker_req = decode_request(queued, fmt)
    assert worker_req == req
    assert (worker_req.options.micro_batch, worker_req.options.timing_repeat, worker_req.model.seed) == (1, 2, 1)
    opts = worker_req.options
    assert all(type(v) is int for v in (opts.micro_batch, worker_req.model.seed, opts.shards))


@pytest.mark.parametrize("options, option", [({"hvp": {"vector": "ones"}}, "hvp.vector"),
                                             ({"checkpoint_segments": 5}, "checkpoint_segments")])
def test_a_bad_option_carries_a_detail_naming_the_option_and_value(client, options, option):
    """These carry their facts in `detail`, not `"detail": {}`."""
    r = post(client, body(options=options))
    err = error_of(r)
    assert r.status_code == 422 and err["code"] == "bad_option", r.text
    assert err["detail"]["option"] == option and err["detail"]["value"] in ("ones", 5), err


@pytest.mark.parametrize("payload, needle", [
    (body(targets=None), "the loss (cross_entropy) needs targets"),
    (body(targets=[0, 1, 2]), "targets for the loss (cross_entropy)"),
    (body(loss="nope"), "the loss: unknown type 'nope'")])
def test_a_single_loss_is_called_the_loss_not_loss_loss(client, payload, needle):
    """Not "targets for loss 'loss' ...", "loss 'loss' needs targets"."""
    err = error_of(post(client, payload))
    assert needle in err["message"] and "'loss'" not in err["message"], err["message"]


@pytest.fixture(scope="module")
def roomy_client():
    app = create_app(Settings(redis_url=dead_redis_url(), redis_timeout_s=0.2))
    with TestClient(app) as c:
        yield c


def test_every_hostile_input_is_answered_without_reprs_or_stock_phrases(roomy_client):
    """The integration suite's hostile corpus, through the one renderer: the rule holds for all of it."""
    from ..integration.test_hostile_input import HOSTILE

    seen = set()
    for name, case in HOSTILE.items():
        content, ctype = case if isinstance(case, tuple) else (json.dumps(case).encode(), "application/json")
        r = roomy_client.post("/gradients?wait=0", content=content, headers={"Content-Type": ctype})
        if r.status_code == 503:  # valid up to the (dead) queue
            continue
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
        err = error_of(r)
        assert len(err["message"]) > 20, (name, err)
        seen.add(err["code"])
    assert len(seen) >= 8, seen


@pytest.mark.parametrize("layers, where", [([{"type": "Sequential", "layers": []}], "layer 0"),
                                           ([{"in_features": 6}], "layer 0")])
def test_structural_faults_inside_layers_are_invalid_body_like_the_schemas(client, layers, where):
    payload = body()
    payload["model"]["layers"] = layers
    err = error_of(post(client, payload))
    assert err["code"] == "invalid_body" and err["message"].startswith(where)
