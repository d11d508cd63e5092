"""POST /estimate's cache (an Engine's caches.estimates): a request seen before costs a look-up,
yet every request is still checked in full, and anything the answer depends on changes the key."""

from __future__ import annotations

import importlib
import threading

import msgspec
import pytest
import torch

from gradsvc.engine import Engine, SpecError
from gradsvc.wire import GradientRequest

from tests.support.nets import SEED_A_LAYERS, seed_a_batch, tensor_json, wide_stack_layers

estimate_module = importlib.import_module("gradsvc.engine.estimate")  # the module (the package re-exports a function of that name)
ENGINE = Engine()  # the API's, in these tests
estimate = ENGINE.estimate


def request(layers, x, y, **kw) -> GradientRequest:
    body = {"model": {"layers": layers, "dtype": kw.pop("dtype", "float64"), "seed": 0},
            "inputs": tensor_json(x), "targets": tensor_json(y), **kw}
    return msgspec.convert(body, GradientRequest)


def uncached(req: GradientRequest):
    ENGINE.caches.estimates.clear()
    return estimate(req)


def test_a_hit_answers_as_a_fresh_estimate_and_skips_the_meta_forward(monkeypatch):
    x, y = seed_a_batch(16)
    req = request(SEED_A_LAYERS, x, y, options={"numcheck": "off"})
    fresh = uncached(req)
    calls = []
    real = estimate_module._estimate
    monkeypatch.setattr(estimate_module, "_estimate", lambda prep: calls.append(1) or real(prep))
    again = estimate(request(SEED_A_LAYERS, x + 1, y, options={"numcheck": "off"}))  # other values, same shapes
    assert msgspec.json.encode(again) == msgspec.json.encode(fresh)
    assert calls == []


def test_a_seen_spec_with_bad_data_is_still_refused():
    x, y = seed_a_batch(4)
    estimate(request(SEED_A_LAYERS, x, y))
    x[1, 2] = float("nan")
    with pytest.raises(SpecError) as err:
        estimate(request(SEED_A_LAYERS, x, y))
    assert err.value.code == "bad_tensor"
    y[0] = 7  # a class index out of range for 3 classes
    with pytest.raises(SpecError):
        estimate(request(SEED_A_LAYERS, torch.zeros(4, 6, dtype=torch.float64), y))


@pytest.mark.parametrize("change", [
    lambda x, y: request(SEED_A_LAYERS, torch.cat([x, x]), torch.cat([y, y])),  # batch size
    lambda x, y: request(SEED_A_LAYERS, x, y, options={"micro_batch": 2}),  # an option
    lambda x, y: request(SEED_A_LAYERS, x.float(), y, dtype="float32"),  # dtype
    lambda x, y: request([*SEED_A_LAYERS[:2], {"type": "Linear", "in_features": 8, "out_features": 3,
                                                "bias": False}], x, y),  # structure
])
def test_what_the_answer_depends_on_changes_the_key(change):
    x, y = seed_a_batch(4)
    estimate(request(SEED_A_LAYERS, x, y))
    changed = change(x, y)
    assert msgspec.json.encode(estimate(changed)) == msgspec.json.encode(uncached(changed))


def test_threads_share_the_cache_and_agree():
    x = torch.randn(8, 64)
    req = request(wide_stack_layers(2, 64), x, x, dtype="float32", loss="mse")
    want = msgspec.json.encode(uncached(req))
    got, errors = [], []

    def run():
        try:
            for _ in range(20):
                got.append(msgspec.json.encode(estimate(req)))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [want] * 80


def test_the_meta_model_is_built_once_per_spec_and_limits_still_apply():
    from gradsvc.engine import EngineConfig, prepare
    from gradsvc.engine.spec import Limits

    x, y = seed_a_batch(4)
    req = request(SEED_A_LAYERS, x, y)
    first = ENGINE.prepare(req, "meta").model
    assert ENGINE.prepare(request(SEED_A_LAYERS, x + 1, y), "meta").model is first
    with pytest.raises(SpecError) as err:  # a built spec is still held to a smaller limit
        prepare(req, EngineConfig(limits=Limits(max_parameters=50)), "meta", caches=ENGINE.caches)
    assert err.value.code == "too_large"
    assert ENGINE.prepare(req, "cpu").model is not first  # a device gets its own model


def test_estimate_leaves_the_shared_meta_model_as_built():
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8},
              {"type": "BatchNorm1d", "num_features": 8, "momentum": None},
              {"type": "Linear", "in_features": 8, "out_features": 3}]
    x, y = seed_a_batch(4)
    req = request(layers, x, y, options={"input_grad": True})
    shared = ENGINE.prepare(req, "meta").model
    uncached(req)
    assert shared[1].momentum is None
    assert ENGINE.prepare(req, "meta").model is shared
