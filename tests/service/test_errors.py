"""One table maps every error code to one status, and each path that produces a code answers with it:
bad inputs through the real app (its Redis is dead, so only what is refused before the queue answers
4xx), engine failures raised by the real engine, and job failures rendered by the one renderer."""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch
from litestar import Litestar, Request, get
from litestar.testing import TestClient

from gradsvc.runtime.settings import Settings
from gradsvc.wire import GradientRequest
from service.app import create_app
from service.error_responses import error_response, handle_exception
from service.exceptions import STATUS, ServiceError
from gradsvc.engine import ComputeError, EngineConfig, compute, resolve_device

from tests.support.nets import SEED_A_LAYERS
from tests.support.stack import dead_redis_url


def body(**changes) -> dict:
    b = {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
         "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]] * 2, "targets": [0, 2], "options": {"numcheck": "off"}}
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = b
        for p in parents:
            node = node[p]
        node[last] = value
    return b


@pytest.fixture(scope="module")
def api() -> TestClient:
    with TestClient(create_app(Settings(redis_url=dead_redis_url(), redis_timeout_s=1,
                                        max_parameters=10_000))) as client:
        yield client


@pytest.mark.parametrize("code, request_body", [
    ("unknown_layer", body(model__layers=[{"type": "Nope"}])),
    ("shape_mismatch", body(model__layers=[{"type": "Linear", "in_features": 5, "out_features": 3}])),
    ("bad_weights", body(model__weights={"9.weight": {"dtype": "float64", "shape": [1], "data": [1.0]}})),
    ("bad_tensor", body(inputs=[[0.1, 0.2], [0.3]])),
    ("bad_loss", body(loss="nope")),
    ("bad_target", body(targets=[0, 1, 2])),
    ("bad_option", body(options={"freeze": ["nope"]})),
    ("too_large", body(model__layers=[{"type": "Linear", "in_features": 6, "out_features": 2000}])),
    ("invalid_body", body(bogus=1)),
    ("malformed_body", b"{not json"),
])
def test_a_bad_request_answers_its_codes_status_from_the_table(api, code, request_body):
    for route in ("/gradients", "/estimate"):
        if isinstance(request_body, bytes):
            r = api.post(route, content=request_body, headers={"content-type": "application/json"})
        else:
            r = api.post(route, json=request_body)
        assert r.json()["error"]["code"] == code, (route, r.text)
        assert r.status_code == STATUS[code] and 400 <= r.status_code < 500


def test_engine_failures_carry_codes_the_table_maps():
    nan_weights = {"0.weight": {"dtype": "float64", "shape": [3, 6], "data": [[1e308] * 6] * 3},
                   "0.bias": {"dtype": "float64", "shape": [3], "data": [0.0] * 3}}
    raised = {}
    with pytest.raises(ComputeError) as info:
        compute(msgspec.convert(body(model__layers=[{"type": "Linear", "in_features": 6, "out_features": 3}],
                                     model__weights=nan_weights), GradientRequest), EngineConfig())
    raised[info.value.code] = info.value
    if not torch.cuda.is_available():
        with pytest.raises(ComputeError) as info:
            resolve_device("cuda")
        raised[info.value.code] = info.value
    assert "non_finite" in raised
    for code in raised:
        assert 400 <= STATUS[code] < 500, code  # the input's doing: never a 5xx


def _renderer_app() -> Litestar:
    @get("/raise/{code:str}")
    async def raise_code(code: str) -> None:
        raise ServiceError(code, f"{code} raised")

    @get("/job/{code:str}")
    async def job_failed(request: Request, code: str) -> object:
        # What POST /gradients answers for a job that failed while it waited.
        return error_response(request, code, f"{code} happened", {}, job_id="j", status="failed")

    return Litestar([raise_code, job_failed], exception_handlers={Exception: handle_exception})


@pytest.mark.parametrize("code", sorted(STATUS))
def test_every_code_renders_under_its_status_raised_or_as_a_failed_job(code):
    with TestClient(_renderer_app()) as client:
        raised = client.get(f"/raise/{code}")
        failed = client.get(f"/job/{code}")
    assert raised.status_code == STATUS[code] and raised.json()["error"]["code"] == code
    assert failed.status_code == STATUS[code] and failed.json()["error"]["code"] == code
    assert failed.json()["job_id"] == "j" and failed.json()["status"] == "failed"


def test_only_503_is_a_5xx_for_input_caused_codes():
    input_codes = ["unknown_layer", "shape_mismatch", "bad_weights", "bad_tensor", "bad_loss", "bad_target",
                   "bad_option", "too_large", "non_finite", "malformed_body", "invalid_body", "body_too_large"]
    assert all(400 <= STATUS[c] < 500 for c in input_codes)
    assert STATUS["queue_unavailable"] == 503
    assert STATUS["out_of_memory"] == 507 and STATUS["timeout"] == 504 and STATUS["worker_lost"] == 503
