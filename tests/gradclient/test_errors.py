"""Every API error code has its SDK exception class; real errors from the stack raise them; retries."""

from __future__ import annotations

import os

import httpx
import msgspec
import pytest
import torch
from torch import nn

import gradclient
from gradclient import Client, errors
from gradsvc import wire
from service.exceptions import STATUS

from gradsvc.runtime.launcher import free_port

from tests.support.stack import RedisServer, Stack, start_stack

LINEAR = [{"type": "Linear", "in_features": 6, "out_features": 3}]
X = [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]]
Y = [0, 2]


def spec(layers=None, **extra) -> dict:
    return {"layers": layers or LINEAR, "dtype": "float64", **extra}


def test_the_sdk_code_list_is_the_api_status_table():
    assert errors.CODES == STATUS == {code: entry.status for code, entry in wire.ERROR_CODES.items()}


@pytest.mark.parametrize("code, parent", [
    ("shape_mismatch", errors.RequestError), ("unauthorized", errors.RequestError),
    ("rate_limited", errors.RequestError), ("worker_lost", errors.JobFailedError),
    ("out_of_memory", errors.JobFailedError), ("timeout", errors.JobFailedError),
    ("non_finite", errors.JobFailedError), ("queue_unavailable", errors.ServiceUnavailableError),
    ("not_ready", errors.ServiceUnavailableError),
])
def test_each_class_sits_under_the_parent_a_caller_catches(code, parent):
    assert issubclass(errors.ERRORS[code], parent)
    assert issubclass(errors.ConnectionFailedError, errors.ServiceUnavailableError)


@pytest.mark.parametrize("wire_format", ["msgpack", "json"])
@pytest.mark.parametrize("code", sorted(STATUS))
def test_every_code_in_an_error_body_raises_its_own_class(code, wire_format):
    def answer(request: httpx.Request) -> httpx.Response:
        body = wire.ErrorBody(error=wire.ErrorInfo(code=code, message=f"{code} happened", detail={"where": "here"}))
        if wire_format == "msgpack":
            return httpx.Response(STATUS[code], content=msgspec.msgpack.encode(body),
                                  headers={"content-type": "application/msgpack"})
        return httpx.Response(STATUS[code], content=msgspec.json.encode(body),
                              headers={"content-type": "application/json"})

    with Client("http://gradsvc.test", retries=0, wire_format=wire_format,
                transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(errors.GradientClientError) as info:
            client.layers()
    exc = info.value
    cls = errors.ERRORS[code]
    assert type(exc) is cls and cls.__name__.endswith("Error") and cls.__name__ in gradclient.__all__
    assert (exc.code, exc.message, exc.detail) == (code, f"{code} happened", {"where": "here"})
    assert exc.status == STATUS[code] and exc.response.status_code == STATUS[code]
    # A job that ran and failed (worker_lost is a 503 too) is never sent again.
    assert exc.is_retryable == (code in ("queue_unavailable", "not_ready", "redis_oom", "redis_readonly",
                                         "redis_unavailable", "server_busy", "session_conflict",
                                         "member_lost"))


def test_one_class_per_code():
    assert len(set(errors.ERRORS.values())) == len(STATUS)


@pytest.mark.parametrize("model, kwargs, cls", [
    (spec([{"type": "Nope"}]), {}, errors.UnknownLayerError),
    (spec([{"type": "Linear", "in_features": 5, "out_features": 3}]), {}, errors.ShapeMismatchError),
    (spec(weights={"0.weight": torch.zeros(2, 2, dtype=torch.float64)}), {}, errors.BadWeightsError),
    (spec(), {"inputs": [[float("nan")] * 6, [0.0] * 6]}, errors.BadTensorError),
    (spec(), {"loss": "nope"}, errors.BadLossError),
    (spec(), {"targets": [0, 1, 2]}, errors.BadTargetError),
    (spec(), {"freeze": ["9"]}, errors.BadOptionError),
    (spec(), {"timing_repeat": 0}, errors.InvalidBodyError),  # a range the schema declares
    (spec([{"type": "Linear", "in_features": 6, "out_features": 20000},
           {"type": "Linear", "in_features": 20000, "out_features": 20000}]), {}, errors.TooLargeError),
    (spec(bogus=1), {}, errors.InvalidBodyError),
    (spec(weights={"0.weight": torch.full((3, 6), 1e308, dtype=torch.float64),
                   "0.bias": torch.zeros(3, dtype=torch.float64)}), {}, errors.NonFiniteError),
])
def test_a_bad_request_raises_the_class_of_the_api_code(client, model, kwargs, cls):
    args = {"inputs": X, "targets": Y, **kwargs}
    with pytest.raises(cls) as info:
        client.gradients(model, args.pop("inputs"), args.pop("targets"), **args)
    assert info.value.response is not None and info.value.status == errors.CODES[cls.code]
    assert info.value.message


def test_a_job_that_failed_while_waited_on_carries_its_job_id(client):
    with pytest.raises(errors.NonFiniteError) as info:
        client.gradients(spec(weights={"0.weight": torch.full((3, 6), 1e308, dtype=torch.float64),
                                       "0.bias": torch.zeros(3, dtype=torch.float64)}), X, Y)
    job = client.job(info.value.job_id)
    assert job.status() == "failed"
    with pytest.raises(errors.NonFiniteError):
        job.result(timeout=5)


def test_unknown_jobs_malformed_bodies_and_wrong_methods_raise_their_classes(client):
    with pytest.raises(errors.NotFoundError):
        client.job("no-such-job").status()
    with pytest.raises(errors.MalformedBodyError):
        client._send("POST", "/gradients", content=b"\xc1 not msgpack")
    with pytest.raises(errors.MethodNotAllowedError):
        client._send("PUT", "/layers")


def test_an_unknown_option_is_refused_before_sending():
    with Client("http://127.0.0.1:9", retries=0) as client:
        with pytest.raises(errors.BadOptionError, match="numchek"):
            client.gradients(spec(), X, Y, numchek="off")
        with pytest.raises(errors.UnsupportedModuleError):  # a forward that fails: no capture can take it
            client.gradients(_Fails(), X, Y)


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        raise ValueError("a bug in forward")


class CountingTransport(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return super().handle_request(request)


def test_connection_errors_are_retried_then_raise_connection_failed():
    transport = CountingTransport()
    with Client(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01, transport=transport) as client:
        with pytest.raises(errors.ConnectionFailedError) as info:
            client.health()
    assert transport.requests == 3 and info.value.is_retryable and info.value.response is None


@pytest.fixture(scope="module")
def strict():
    """A stack with API keys, a rate limit, small body/result limits and a 2 s job timeout."""
    s = start_stack(workers=1, GRADSVC_API_KEYS="key-a,key-b,key-warm", GRADSVC_RATE_LIMIT_PER_MINUTE="3",
                    GRADSVC_MAX_BODY_BYTES="1000000", GRADSVC_MAX_RESULT_BYTES="4000", GRADSVC_JOB_TIMEOUT_S="2")
    yield s
    s.stop()


def test_limits_and_keys_raise_their_classes(strict):
    with Client(strict.base_url, api_key="wrong", retries=0) as anon:
        with pytest.raises(errors.UnauthorizedError):
            anon.layers()
    with Client(strict.base_url, api_key="key-warm", retries=0) as warm:
        for _ in range(3):  # warms the worker (a first job on a loaded machine can pass 2 s itself)
            try:
                warm.gradients(spec(), X, Y, numcheck="off")
                break
            except errors.JobTimeoutError:
                continue
    with Client(strict.base_url, api_key="key-a", retries=0) as client:
        with pytest.raises(errors.BodyTooLargeError):
            client.gradients(spec(), torch.zeros(30000, 6, dtype=torch.float64), torch.zeros(30000, dtype=torch.long))
        with pytest.raises(errors.ResultTooLargeError):
            client.gradients(spec([{"type": "Linear", "in_features": 6, "out_features": 600}]), X, Y, numcheck="off")
        # ~19k parameters checked exactly on a batch of 512: far past 2 s of finite differences
        slow = spec([{"type": "Linear", "in_features": 120, "out_features": 120}, {"type": "Tanh"},
                     {"type": "Linear", "in_features": 120, "out_features": 36}])
        x = torch.randn(512, 120, dtype=torch.float64)
        with pytest.raises(errors.JobTimeoutError):
            client.gradients(slow, x, torch.randint(0, 36, (512,)), numcheck="exact", memory=False)
    with Client(strict.base_url, api_key="key-b", retries=0) as other:
        with pytest.raises(errors.RateLimitedError) as info:
            for _ in range(4):
                other.submit(spec(), X, Y, numcheck="off")
        assert info.value.retry_after_s and info.value.retry_after_s > 0


def test_outages_raise_503_classes_after_retrying(tmp_path):
    """An API with no worker is not ready; with Redis gone the queue is unavailable. Both are retried."""
    redis = RedisServer(free_port()).start()
    port = free_port()
    env = {**os.environ, "GRADSVC_REDIS_URL": redis.url, "GRADSVC_PORT": str(port), "GRADSVC_LOG_LEVEL": "warning",
           "GRADSVC_REDIS_TIMEOUT_S": "0.5"}
    bare = Stack(redis=redis, env=env, api_port=port, metrics_port=0, logdir=tmp_path)
    try:
        bare.start_api()
        transport = CountingTransport()
        with Client(bare.base_url, retries=2, backoff_s=0.01, transport=transport) as client:
            with pytest.raises(errors.NotReadyError) as info:
                client.health(ready=True)
            assert transport.requests == 3 and info.value.is_retryable
        redis.stop()
        with Client(bare.base_url, retries=0) as client:  # its Retry-After is 2 s: no retry here
            with pytest.raises(errors.QueueUnavailableError):
                client.submit(spec(), X, Y)
    finally:
        bare.stop()
