"""The engine against local PyTorch autograd (the answer key), as micrograd's tests do."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F

from gradsvc.engine import ComputeError, EngineConfig, SpecError, compute, estimate
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest

from tests.support.nets import SEED_A_LAYERS, seed_a_batch, seed_a_module, tensor_json, wide_stack_layers


def request(layers, x, y, **kw) -> GradientRequest:
    body = {"model": {"layers": layers, "dtype": kw.pop("dtype", "float64"), "seed": kw.pop("seed", 0)},
            "inputs": tensor_json(x), "targets": tensor_json(y), **kw}
    return msgspec.convert(body, GradientRequest)


def grad_of(result, name) -> torch.Tensor:
    return decode(result.gradients[name], where=name, max_elements=1 << 40)


def test_seed_a_gradients_equal_local_autograd_and_pass_exact_numcheck():
    x, y = seed_a_batch()
    result = compute(request(SEED_A_LAYERS, x, y, loss="cross_entropy", options={"numcheck": "exact"}))
    model = seed_a_module()
    F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(grad_of(result, name), p.grad, rtol=0, atol=1e-12), name
    assert result.parameter_count == 83
    assert result.numcheck.mode == "exact"
    assert result.numcheck.evaluations == 166
    assert result.numcheck.max_rel_error < 1e-8
    assert result.numcheck.passed
    assert set(result.numcheck.per_parameter) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_numcheck_runs_in_float64_for_a_float32_request():
    x, y = seed_a_batch()
    result = compute(request(SEED_A_LAYERS, x.float(), y, dtype="float32", options={"numcheck": "exact"}))
    assert result.dtype == "float32"
    assert result.gradients["0.weight"].dtype == "float32"
    assert result.numcheck.dtype == "float64"
    assert result.numcheck.max_rel_error < 1e-8


def test_sampled_numcheck_checks_k_elements_per_tensor():
    x, y = seed_a_batch()
    result = compute(request(SEED_A_LAYERS, x, y, options={"numcheck": "sampled", "numcheck_samples": 3}))
    checked = {k: v.checked for k, v in result.numcheck.per_parameter.items()}
    assert checked == {"0.weight": 3, "0.bias": 3, "2.weight": 3, "2.bias": 3}
    assert result.numcheck.evaluations == 24


def test_auto_numcheck_switches_above_the_exact_limit():
    x, y = seed_a_batch()
    result = compute(request(SEED_A_LAYERS, x, y), EngineConfig(numcheck_exact_max=50))
    assert result.numcheck.mode != "exact"


def test_wide_stack_saves_exactly_two_mib_per_layer():
    # The backprop memory measurement: Linear(1024,1024)+ReLU at batch 512, float32: one layer output kept per layer.
    x = torch.randn(512, 1024)
    totals = {}
    for depth in (1, 2, 4):
        r = compute(request(wide_stack_layers(depth), x, x, dtype="float32", loss="mse", options={"numcheck": "off"}))
        totals[depth] = r.memory.saved_bytes_total
        assert sum(layer.saved_bytes for layer in r.memory.layers) == r.memory.saved_bytes_total
    assert totals[2] - totals[1] == 2 * 1024 * 1024
    assert totals[4] - totals[2] == 2 * 2 * 1024 * 1024


def test_estimate_on_meta_equals_the_measured_memory():
    x, y = seed_a_batch(16)
    req = request(SEED_A_LAYERS, x, y, options={"numcheck": "off"})
    assert estimate(req).memory.saved_bytes_total == compute(req).memory.saved_bytes_total
    assert estimate(req).parameter_count == 83


def test_given_weights_are_used():
    x, y = seed_a_batch()
    model = seed_a_module(seed=7)
    weights = {k: tensor_json(v) for k, v in model.state_dict().items()}
    body = {"model": {"layers": SEED_A_LAYERS, "dtype": "float64", "seed": 0, "weights": weights},
            "inputs": tensor_json(x), "targets": tensor_json(y), "options": {"numcheck": "off"}}
    result = compute(msgspec.convert(body, GradientRequest))
    F.cross_entropy(model(x), y).backward()
    assert torch.equal(grad_of(result, "2.weight"), model[2].weight.grad)


@pytest.mark.parametrize(
    "weights, fragment",
    [
        ({"0.weight": torch.zeros(8, 6)}, "'0.bias' is missing"),
        ({"9.weight": torch.zeros(1)}, "unknown parameter '9.weight'"),
    ],
)
def test_bad_weights_name_the_parameter(weights, fragment):
    x, y = seed_a_batch()
    body = {"model": {"layers": SEED_A_LAYERS, "weights": {k: tensor_json(v) for k, v in weights.items()}},
            "inputs": tensor_json(x.float()), "targets": tensor_json(y)}
    with pytest.raises(SpecError) as info:
        compute(msgspec.convert(body, GradientRequest))
    assert info.value.code == "bad_weights"
    assert fragment in info.value.message


def test_non_finite_output_names_the_first_layer():
    x, y = seed_a_batch()
    layers = [SEED_A_LAYERS[0], SEED_A_LAYERS[2]]
    weights = {k: tensor_json(v) for k, v in seed_a_module().float().state_dict().items()}
    weights["0.weight"] = tensor_json(torch.full((8, 6), 1e38))
    weights = {k.replace("2.", "1."): v for k, v in weights.items()}
    body = {"model": {"layers": layers, "dtype": "float32", "weights": weights},
            "inputs": tensor_json(x.float() + 10), "targets": tensor_json(y)}
    with pytest.raises(ComputeError) as info:
        compute(msgspec.convert(body, GradientRequest))
    assert info.value.code == "non_finite"
    assert "layer 0 (Linear)" in info.value.message


def test_non_finite_loss_is_reported_as_such():
    x = torch.full((4, 6), 1e20)
    layers = [{"type": "Linear", "in_features": 6, "out_features": 3}]
    with pytest.raises(ComputeError) as info:
        compute(request(layers, x.float(), torch.zeros(4, 3), dtype="float32", loss="mse"))
    assert info.value.code == "non_finite"
    assert "the loss" in info.value.message


@pytest.mark.parametrize("shape", [[2**64, 0], [2**62, 4, 0], [0, 2**63], [0, 2**26, 2**26, 2**26]])
@pytest.mark.parametrize("given", [{"b64": ""}, {"data": b""}, {"data": []}, {}])
def test_an_empty_tensor_whose_other_sizes_overflow_is_too_large(shape, given):
    from gradsvc.wire import Tensor

    with pytest.raises(SpecError) as err:
        decode(Tensor(dtype="float32", shape=shape, **given), where="inputs", max_elements=1 << 20, shape_only=True)
    assert err.value.code == "too_large" and "zero size" in err.value.message
    assert decode(Tensor(dtype="float32", shape=[0, 1 << 20], b64=""), where="inputs", max_elements=1 << 20).shape == \
        (0, 1 << 20)


@pytest.mark.parametrize("bad", ["0.bias", "2.weight", "2.bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_named_whichever_weights_are_checked_together(bad, value):
    """decode_weights checks small parameters for NaN and infinity in one pass: the one that holds it is still
    the one named, and a shape fault after it comes second."""
    x, y = seed_a_batch()
    state = {k: v.clone() for k, v in seed_a_module().state_dict().items()}
    state[bad].view(-1)[-1] = value
    weights = {k: tensor_json(v) for k, v in state.items()}
    body = {"model": {"layers": SEED_A_LAYERS, "dtype": "float64", "weights": weights},
            "inputs": tensor_json(x), "targets": tensor_json(y), "options": {"numcheck": "off"}}
    with pytest.raises(SpecError) as info:
        compute(msgspec.convert(body, GradientRequest))
    assert info.value.code == "bad_weights" and info.value.detail["parameter"] == bad
    assert f"{bad!r} holds NaN or infinite values" in info.value.message
    if bad != "2.bias":  # a wrong shape named after it: the non-finite weight, which comes first, is named
        weights["2.bias"] = tensor_json(torch.zeros(5, dtype=torch.float64))
        with pytest.raises(SpecError) as info:
            compute(msgspec.convert({**body, "model": {**body["model"], "weights": weights}}, GradientRequest))
        assert info.value.detail["parameter"] == bad
