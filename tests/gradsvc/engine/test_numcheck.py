"""The numerical check catches wrong gradients in every mode, and the init cache never leaks state."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradsvc.engine import Engine, EngineConfig, compute
from gradsvc.engine.numcheck import tolerances
from gradsvc.engine.numcheck.run import CheckRun, run
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest

from tests.support.nets import seed_a_batch, seed_a_module, tensor_json


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
    good = run(CheckRun(mode, params, loss_fn, grads, **kw))
    assert good.passed and good.max_rel_error < 1e-7
    wrong = {n: g * (1.01 if n == "2.weight" else 1.0) for n, g in grads.items()}
    bad = run(CheckRun(mode, params, loss_fn, wrong, **kw))
    assert not bad.passed and bad.max_rel_error > 1e-3
    assert bad.rounding_floor > 0


def test_parameters_are_restored_after_the_check():
    params, loss_fn, grads = _setup()
    before = {n: p.detach().clone() for n, p in params.items()}
    run(CheckRun("directional", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=4, directions=4, seed=0))
    run(CheckRun("exact", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=4, directions=4, seed=0))
    for n, p in params.items():
        assert torch.allclose(p, before[n], rtol=0, atol=1e-15)


def test_cached_initial_state_is_copied_not_shared():
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8},
              {"type": "BatchNorm1d", "num_features": 8}, {"type": "Linear", "in_features": 8, "out_features": 3}]
    x, y = seed_a_batch(8)
    body = {"model": {"layers": layers, "dtype": "float64", "seed": 4}, "inputs": tensor_json(x),
            "targets": tensor_json(y), "options": {"numcheck": "off"}}
    req = msgspec.convert(body, GradientRequest)
    engine = Engine(EngineConfig())
    first = engine.compute(req)
    cached = engine.caches.initial_states.values()
    assert cached and torch.equal(cached[-1]["1.running_mean"], torch.zeros(8, dtype=torch.float64))
    second = engine.compute(req)
    assert first.gradients == second.gradients
    assert torch.equal(cached[-1]["1.running_mean"], torch.zeros(8, dtype=torch.float64))


# --- the returned gradients, judged against the float64 reference -------------------------------------------
SMALL_MLP = [{"type": "Linear", "in_features": 6, "out_features": 16}, {"type": "Tanh"},
             {"type": "Linear", "in_features": 16, "out_features": 16}, {"type": "ReLU"},
             {"type": "Linear", "in_features": 16, "out_features": 3}]


def _compute(layers, dtype, n=16, **options):
    x, y = seed_a_batch(n)
    body = {"model": {"layers": layers, "dtype": dtype, "seed": 0}, "inputs": tensor_json(x),
            "targets": tensor_json(y), "options": options}
    return compute(msgspec.convert(body, GradientRequest), EngineConfig())


def test_float32_micro_batched_mlp_reports_its_returned_error_and_passes():
    check = _compute(SMALL_MLP, "float32", micro_batch=4, numcheck="exact").numcheck
    assert 0 < check.returned_max_rel_error < 1e-4  # float32 rounding, measured against float64
    assert check.returned_tolerance == 1e-4 and check.passed
    assert set(check.per_parameter) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    assert all(0 < c.returned_max_rel_error < 1e-4 for c in check.per_parameter.values())


@pytest.mark.parametrize("options", [{"micro_batch": 3}, {"checkpoint_segments": 2}, {"micro_batch": 5,
                                     "checkpoint_segments": 3, "numcheck": "directional"}])
def test_float64_returned_gradients_equal_the_reference_to_1e_10_however_they_were_computed(options):
    check = _compute(SMALL_MLP + [{"type": "Dropout", "p": 0.3}], "float64", **{"numcheck": "exact", **options}).numcheck
    assert check.returned_max_rel_error < 1e-12 and check.returned_tolerance == 1e-10 and check.passed


@pytest.mark.parametrize("dtype, tolerance", [("float16", 16 * 2.0**-10), ("bfloat16", 16 * 2.0**-7)])
def test_half_precision_tolerance_is_at_least_16_epsilons_and_reported_per_tensor(dtype, tolerance):
    check = _compute(SMALL_MLP, dtype, micro_batch=4, numcheck="exact").numcheck
    own = [p.returned_tolerance for p in check.per_parameter.values()]
    assert min(own) >= tolerance and check.returned_tolerance == max(own) <= tolerances.ARITHMETIC_MAX
    assert 0 < check.returned_max_rel_error < check.returned_tolerance and check.passed


def test_a_wrong_returned_gradient_fails_the_check_in_every_mode():
    params, loss_fn, grads = _setup()
    kw = dict(eps=1e-6, tolerance=1e-6, samples=4, directions=8, seed=0, returned_dtype=torch.float32)
    for mode in ("exact", "sampled", "directional"):
        good = run(CheckRun(mode, params, loss_fn, grads, returned={n: g.float() for n, g in grads.items()}, **kw))
        assert good.passed and good.returned_max_rel_error < 1e-6, mode
        off = {n: (g * 1.001 if n == "2.weight" else g).float() for n, g in grads.items()}
        bad = run(CheckRun(mode, params, loss_fn, grads, returned=off, **kw))
        assert not bad.passed and bad.max_rel_error < 1e-6, mode  # finite differences alone would pass
        assert bad.per_parameter["2.weight"].returned_max_rel_error > 9e-4, mode
        assert bad.per_parameter["0.weight"].returned_max_rel_error < 1e-6, mode
        if mode == "directional":
            assert all(c.checked == 0 for c in bad.per_parameter.values())


def test_directional_mode_judges_the_returned_gradient_along_its_directions():
    ref = {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    # Element-wise within 1e-4 of its scale, yet along (1, 1)/sqrt(2) the two cancel: 2e-5 of ~0.
    along = [(2e-5, 0.0, 2 ** 0.5)]
    assert tolerances.returned_check(ref, ref, torch.float32, along).passed  # under tolerance x the terms
    bad = tolerances.returned_check(ref, ref, torch.float32, [(0.5, 0.3, 0.5)])
    assert not bad.passed and bad.max_rel_error == pytest.approx(0.4)


def test_a_gradient_that_cancels_to_zero_passes_under_the_floor_not_by_its_ratio():
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "BatchNorm1d", "num_features": 8},
              {"type": "Tanh"}, {"type": "Linear", "in_features": 8, "out_features": 3}]
    check = _compute(layers, "float32", numcheck="exact").numcheck
    # BatchNorm removes the mean, so the bias before it has a zero gradient up to rounding: no scale of its own.
    bias = check.per_parameter["0.bias"]
    assert bias.returned_max_rel_error > 1e-4 and check.passed
    assert check.returned_floor == pytest.approx(1e-4 * max(
        float(decode(g, where="g", max_elements=1 << 30).abs().max()) for g in _compute(
            layers, "float64", numcheck="off").gradients.values()), rel=1e-3)


def test_numcheck_off_says_nothing_was_checked():
    result = _compute(SMALL_MLP, "float32", numcheck="off")
    check = result.numcheck
    assert check.mode == "off" and check.evaluations == 0 and check.passed is None  # not run: neither verdict
    assert msgspec.json.decode(msgspec.json.encode(result))["numcheck"]["passed"] is None
    # With the check off, returned_tolerance is 0.0 like tolerance, not float32's 1e-4 (1e-10 in float64).
    assert check.tolerance == check.returned_tolerance == check.returned_floor == 0.0
