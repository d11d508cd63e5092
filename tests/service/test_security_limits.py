"""Auth, rate limiting, size limits, bind policy and Redis outages, without a stack: the Litestar
TestClient for the app, fakeredis for the rate-limit counters."""

from __future__ import annotations

import copy
import hashlib
import logging
import time

import fakeredis
import pytest
from litestar.testing import TestClient

from gradsvc.runtime.settings import Settings, SettingsError
from service.app import create_app
from service.auth import ANONYMOUS, Auth
from service.exceptions import ServiceError

from tests.support.nets import SEED_A_LAYERS
from tests.support.stack import dead_redis_url


def body(**model) -> dict:
    return {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0, **model},
            "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]], "targets": [1], "options": {"numcheck": "off"}}


class _Req:
    def __init__(self, authorization: str | None) -> None:
        self.headers = {"authorization": authorization} if authorization is not None else {}


# --- API keys -------------------------------------------------------------------------------------------
def test_without_keys_every_caller_is_anonymous():
    auth = Auth(Settings(), fakeredis.FakeRedis())
    assert not auth.enabled and auth.owner(_Req(None)) == ANONYMOUS


def test_owner_is_a_digest_of_the_key_never_the_key(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# comment\nfile-key-1\n\n")
    auth = Auth(Settings(api_keys=("env-key-1",), api_keys_file=str(keyfile)), fakeredis.FakeRedis())
    for key in ("env-key-1", "file-key-1"):
        owner = auth.owner(_Req(f"Bearer {key}"))
        assert owner == hashlib.sha256(key.encode()).hexdigest()[:24] and key not in owner
    assert auth.owner(_Req("Bearer env-key-1")) != auth.owner(_Req("Bearer file-key-1"))


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer wrong", "Basic ZW52LWtleS0xOg==", "env-key-1",
                                    "Bearer env-key-", "Bearer env-key-11", "Bearer # comment"])
def test_missing_or_wrong_key_is_unauthorized(header):
    auth = Auth(Settings(api_keys=("env-key-1",)), fakeredis.FakeRedis())
    with pytest.raises(ServiceError) as err:
        auth.owner(_Req(header))
    assert err.value.code == "unauthorized" and err.value.status == 401
    assert err.value.headers == {"WWW-Authenticate": "Bearer"}


def test_keys_are_compared_in_constant_time(monkeypatch):
    import service.auth as auth_module

    compared = []
    real = auth_module.hmac.compare_digest
    monkeypatch.setattr(auth_module.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    auth = Auth(Settings(api_keys=("k1", "k2", "k3")), fakeredis.FakeRedis())
    auth.owner(_Req("Bearer k1"))
    assert len(compared) == 3  # every key, even after a match: no early exit to time


# --- rate limit -----------------------------------------------------------------------------------------
def test_rate_limit_allows_the_limit_then_429_with_retry_after_per_key():
    auth = Auth(Settings(rate_limit_per_minute=3), fakeredis.FakeRedis())
    if 60 - time.time() % 60 < 2:
        time.sleep(2)  # stay inside one fixed window
    for _ in range(3):
        auth.check_rate("alice")
    with pytest.raises(ServiceError) as err:
        auth.check_rate("alice")
    assert err.value.code == "rate_limited" and err.value.status == 429
    retry = int(err.value.headers["Retry-After"])
    assert 1 <= retry <= 60 and err.value.detail["retry_after_s"] == retry
    # The message names the setting that sets the limit.
    assert "GRADSVC_RATE_LIMIT_PER_MINUTE=3" in err.value.message
    assert err.value.detail["setting"] == "GRADSVC_RATE_LIMIT_PER_MINUTE" and err.value.detail["limit"] == 3
    auth.check_rate("bob")  # another key has its own window


def test_rate_limit_zero_is_off():
    auth = Auth(Settings(rate_limit_per_minute=0), fakeredis.FakeRedis())
    for _ in range(1000):
        auth.check_rate("alice")


# --- settings and bind policy ----------------------------------------------------------------------------
@pytest.mark.parametrize("var, value", [("GRADSVC_MAX_BODY_BYTES", "0"), ("GRADSVC_MAX_PARAMETERS", "-1"),
                                        ("GRADSVC_MAX_LAYERS", "x"), ("GRADSVC_RATE_LIMIT_PER_MINUTE", "-5"),
                                        ("GRADSVC_WORKER_HEARTBEAT_S", "0")])
def test_a_bad_limit_fails_at_start_up_naming_the_variable(var, value):
    with pytest.raises(SettingsError, match=var):
        Settings.from_env({var: value})


def test_limits_default_as_documented():
    s = Settings.from_env({})
    assert (s.max_body_bytes, s.max_parameters, s.max_elements, s.max_layers, s.max_depth, s.max_result_bytes) == \
        (268435456, 200_000_000, 64_000_000, 512, 8, 1073741824)
    assert (s.host, s.api_keys, s.rate_limit_per_minute) == ("127.0.0.1", (), 0)


def _startup_log(settings: Settings) -> list[str]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("gradsvc.api")
    logger.addHandler(handler)
    try:
        with TestClient(create_app(settings)) as client:
            assert client.get("/healthz").status_code == 200
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records]


def test_without_keys_the_start_up_log_says_every_caller_is_trusted_on_loopback_only():
    messages = _startup_log(Settings(redis_url=dead_redis_url()))
    assert any("no API keys" in m and "127.0.0.1" in m and "only" in m for m in messages), messages


def test_without_keys_beyond_loopback_the_start_up_log_warns_that_anyone_can_submit():
    messages = _startup_log(Settings(redis_url=dead_redis_url(), host="0.0.0.0"))
    assert any("GRADSVC_HOST='0.0.0.0'" in m and "anyone" in m and "GRADSVC_API_KEYS" in m for m in messages)
    assert Settings(host="0.0.0.0", api_keys=("k",)).exposure_warning() is None


# --- limits, each a clear 413/422, checked before anything touches Redis -----------------------------------
@pytest.fixture()
def limited() -> TestClient:
    settings = Settings(redis_url=dead_redis_url(), max_body_bytes=20_000, max_parameters=500, max_elements=100,
                        max_layers=4, max_depth=2)
    with TestClient(create_app(settings)) as client:
        yield client


def test_a_body_over_max_body_bytes_is_413(limited):
    big = body()
    big["inputs"] = [[0.5] * 6] * 1000
    r = limited.post("/gradients", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("mutate, word", [
    (lambda b: b["model"].update(layers=[{"type": "Linear", "in_features": 6, "out_features": 100}]), "parameters"),
    (lambda b: b.update(inputs=[[0.5] * 6] * 20, targets=[1] * 20), "elements"),
    (lambda b: b["model"].update(layers=[{"type": "Tanh"}] * 5 + copy.deepcopy(SEED_A_LAYERS)), "layers"),
    (lambda b: b["model"].update(layers=[{"type": "Sequential", "layers": [{"type": "Sequential", "layers": [
        {"type": "Sequential", "layers": copy.deepcopy(SEED_A_LAYERS)}]}]}]), "nest"),
])
def test_each_size_limit_is_a_422_too_large_naming_it(limited, mutate, word):
    b = body()
    mutate(b)
    for route in ("/gradients", "/estimate"):
        r = limited.post(route, json=b)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "too_large", error
        assert word in error["message"].lower(), error["message"]


def test_a_body_nested_past_the_decoder_is_422_not_500(limited):
    # 1400 levels in 18 kB: under the 20 kB body limit, so the decoder itself meets the nesting.
    deep = b'{"model":{"layers":[' + b'{"layers":[' * 1400 + b"]}" * 1400 + b']},"inputs":[1]}'
    assert len(deep) < 20_000
    for route in ("/gradients", "/estimate"):
        r = limited.post(route, content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "too_large" and "nest" in error["message"].lower(), error


# --- Redis down ------------------------------------------------------------------------------------------
def test_with_redis_down_every_queue_route_answers_503_within_seconds():
    with TestClient(create_app(Settings(redis_url=dead_redis_url(), redis_timeout_s=1))) as client:
        for method, path, kwargs in [("POST", "/gradients", {"json": body()}), ("GET", "/jobs/abc", {}),
                                     ("POST", "/jobs/abc/cancel", {}), ("GET", "/readyz", {})]:
            t = time.monotonic()
            r = client.request(method, path, **kwargs)
            assert time.monotonic() - t < 3
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["code"] == "queue_unavailable"
            assert r.headers["retry-after"]
        assert client.get("/healthz").status_code == 200
        assert client.post("/estimate", json=body()).status_code == 200  # needs no queue


def test_metrics_asks_for_a_key_only_when_the_setting_closes_it():
    for require, status in ((False, 200), (True, 401)):
        settings = Settings(redis_url=dead_redis_url(), redis_timeout_s=0.2, api_keys=("k1",),
                            metrics_require_key=require)
        with TestClient(create_app(settings)) as client:
            r = client.get("/metrics")
            assert r.status_code in ((status,) if status == 401 else (200, 503)), r.text
            if require:
                assert r.json()["error"]["code"] == "unauthorized"
                assert client.get("/metrics", headers={"Authorization": "Bearer k1"}).status_code in (200, 503)


def test_the_schema_and_the_docs_ask_for_a_key_only_when_the_setting_closes_them():
    for require in (False, True):
        settings = Settings(redis_url=dead_redis_url(), redis_timeout_s=0.2, api_keys=("k1",), docs_require_key=require)
        with TestClient(create_app(settings)) as client:
            schema, docs = client.get("/schema"), client.get("/docs", follow_redirects=False)
            assert (schema.status_code, docs.status_code) == ((401, 303) if require else (200, 200)), schema.text
            keyed = client.get("/schema", headers={"Authorization": "Bearer k1"})
            assert keyed.status_code == 200 and keyed.json()["security"] == [{"apiKey": []}]
            assert client.get("/", follow_redirects=False).headers["location"] == "/docs"


def test_readyz_needs_no_key_even_with_keys_set():
    settings = Settings(redis_url=dead_redis_url(), redis_timeout_s=0.2, api_keys=("k1",))
    with TestClient(create_app(settings)) as client:
        assert client.get("/readyz").json()["error"]["code"] == "queue_unavailable"  # not unauthorized
        assert client.get("/healthz").status_code == 200
        assert client.get("/layers").status_code == 401


# --- settings: a bad value stops the process naming the variable ----------------------------------------
@pytest.mark.parametrize("var, value, says", [("GRADSVC_LOG_LEVEL", "loud", "debug, info, warning, error, critical"),
                                              ("GRADSVC_METRICS_REQUIRE_KEY", "maybe", "true"),
                                              ("GRADSVC_PORT", "eighty", "an integer")])
def test_a_bad_setting_names_the_variable_and_the_valid_values(var, value, says):
    with pytest.raises(SettingsError) as info:
        Settings.from_env({var: value})
    assert var in str(info.value) and says in str(info.value)


def test_gradsvc_serve_with_a_bad_log_level_exits_with_a_message_not_a_traceback():
    import os
    import subprocess
    import sys

    env = {**os.environ, "GRADSVC_LOG_LEVEL": "loud"}
    out = subprocess.run([sys.executable, "-m", "gradsvc.runtime.cli", "serve"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 2
    assert "GRADSVC_LOG_LEVEL='loud'" in out.stderr and "Traceback" not in out.stderr


def test_log_levels_are_read_in_any_case():
    assert Settings.from_env({"GRADSVC_LOG_LEVEL": "WARNING"}).log_level == "WARNING"
    assert Settings.from_env({"GRADSVC_METRICS_REQUIRE_KEY": "yes"}).metrics_require_key is True
