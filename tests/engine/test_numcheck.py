"""The numerical check catches wrong gradients in every mode, and the init cache never leaks state."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradsvc.wire import GradientRequest
from workers.engine import EngineConfig, compute, numcheck
from workers.engine.prepare import _init_cache

from ..nets import seed_a_batch, seed_a_module, tensor_json


def _setup():
    model = seed_a_module()
    x, y = seed_a_batch()
    params = dict(model.named_parameters())

    def loss_fn():
        return torch.nn.functional.cross_entropy(model(x), y)

    grads = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))
    return params, loss_fn, grads


@pytest.mark.parametrize("mode", ["exact", "sampled", "directional"])
def test_right_gradients_pass_and_a_wrong_one_fails(mode):
    params, loss_fn, grads = _setup()
    kw = dict(eps=1e-6, tolerance=1e-6, samples=4, directions=8, seed=0)
    good = numcheck.run(mode, params, loss_fn, grads, **kw)
    assert good.passed and good.max_rel_error < 1e-7
    wrong = {n: g * (1.01 if n == "2.weight" else 1.0) for n, g in grads.items()}
    bad = numcheck.run(mode, params, loss_fn, wrong, **kw)
    assert not bad.passed and bad.max_rel_error > 1e-3
    assert bad.rounding_floor > 0


def test_parameters_are_restored_after_the_check():
    params, loss_fn, grads = _setup()
    before = {n: p.detach().clone() for n, p in params.items()}
    numcheck.run("directional", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=4, directions=4, seed=0)
    numcheck.run("exact", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=4, directions=4, seed=0)
    for n, p in params.items():
        assert torch.allclose(p, before[n], rtol=0, atol=1e-15)


def test_cached_initial_state_is_copied_not_shared():
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8},
              {"type": "BatchNorm1d", "num_features": 8}, {"type": "Linear", "in_features": 8, "out_features": 3}]
    x, y = seed_a_batch(8)
    body = {"model": {"layers": layers, "dtype": "float64", "seed": 4}, "inputs": tensor_json(x),
            "targets": tensor_json(y), "options": {"numcheck": "off"}}
    req = msgspec.convert(body, GradientRequest)
    first = compute(req, EngineConfig())
    cached = [st for key, st in _init_cache.items() if key[2] == 4]
    assert cached and torch.equal(cached[-1]["1.running_mean"], torch.zeros(8, dtype=torch.float64))
    second = compute(req, EngineConfig())
    assert first.gradients == second.gradients
    assert torch.equal(cached[-1]["1.running_mean"], torch.zeros(8, dtype=torch.float64))
