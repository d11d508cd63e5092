"""Every option of the seed articles, each against local PyTorch in float64 (1e-10)."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsvc.engine import EngineConfig, SpecError, compute, estimate, prepare
from gradsvc.engine.spec import Residual
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest

from tests.support.nets import SEED_A_LAYERS, seed_a_batch, seed_a_module, tensor_json, wide_stack_layers

TOL = 1e-10


def T(wire) -> torch.Tensor:
    return decode(wire, where="test", max_elements=1 << 40)


def run(layers, x, targets, **kw):
    body = {"model": {"layers": layers, "dtype": "float64", "seed": kw.pop("seed", 0)}, "inputs": tensor_json(x),
            "targets": targets if isinstance(targets, dict) and "dtype" not in targets else tensor_json(targets),
            "options": {"numcheck": "off", **kw.pop("options", {})}, **kw}
    return compute(msgspec.convert(body, GradientRequest))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=TOL)


# --- several losses over one graph ----------------------------------------------------------------
TWO_HEAD = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Tanh"},
            {"type": "Linear", "in_features": 8, "out_features": 3}]


def test_several_losses_give_per_loss_gradients_the_weighted_sum_and_cosines():
    x, y = seed_a_batch(8)
    soft = torch.softmax(torch.randn(8, 3, dtype=torch.float64), 1)
    losses = [{"name": "task", "type": "cross_entropy", "weight": 1.0, "target": "y"},
              {"name": "distill", "type": "mse", "weight": 0.5, "target": "soft"}]
    r = run(TWO_HEAD, x, {"y": tensor_json(y), "soft": tensor_json(soft)}, losses=losses)
    model = seed_a_module()
    out = model(x)
    l1, l2 = F.cross_entropy(out, y), F.mse_loss(out, soft)
    g1 = torch.autograd.grad(l1, list(model.parameters()), retain_graph=True)
    g2 = torch.autograd.grad(l2, list(model.parameters()))
    names = [n for n, _ in model.named_parameters()]
    for i, n in enumerate(names):
        assert close(T(r.per_loss_gradients["task"][n]), g1[i])
        assert close(T(r.per_loss_gradients["distill"][n]), g2[i])
        assert close(T(r.gradients[n]), g1[i] + 0.5 * g2[i])
    assert r.losses == pytest.approx({"task": l1.item(), "distill": l2.item()}, abs=1e-12)
    assert r.loss == pytest.approx((l1 + 0.5 * l2).item(), abs=1e-12)
    flat1, flat2 = torch.cat([g.reshape(-1) for g in g1]), torch.cat([g.reshape(-1) for g in g2])
    assert r.gradient_cosine["task|distill"] == pytest.approx(float(F.cosine_similarity(flat1, flat2, 0)), abs=1e-10)


def test_opposed_losses_show_a_negative_cosine():
    x, y = seed_a_batch(8)
    target = torch.randn(8, 3, dtype=torch.float64)
    losses = [{"name": "up", "type": "mse", "target": "t"}, {"name": "down", "type": "mse", "target": "minus_t"}]
    r = run(TWO_HEAD, x, {"t": tensor_json(target * 10), "minus_t": tensor_json(-target * 10)}, losses=losses)
    assert r.gradient_cosine["up|down"] < 0


# --- second order -----------------------------------------------------------------------------------
def test_input_gradient_equals_local():
    x, y = seed_a_batch()
    r = run(SEED_A_LAYERS, x, y, options={"input_grad": True})
    model = seed_a_module()
    xl = x.clone().requires_grad_(True)
    F.cross_entropy(model(xl), y).backward()
    assert close(T(r.input_gradient), xl.grad)


def test_hessian_vector_product_equals_local_double_backward():
    x, y = seed_a_batch()
    model = seed_a_module()
    g = torch.Generator().manual_seed(5)
    vec = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters()}
    r = run(SEED_A_LAYERS, x, y, options={"hvp": {"vector": {n: tensor_json(v) for n, v in vec.items()}}})
    params = list(model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
    hv = torch.autograd.grad(grads, params, grad_outputs=list(vec.values()))
    for (n, _), h in zip(model.named_parameters(), hv):
        assert close(T(r.hvp[n]), h), n


def test_random_hvp_vector_is_reproducible_from_its_seed():
    x, y = seed_a_batch()
    a = run(SEED_A_LAYERS, x, y, options={"hvp": {"vector": "random", "seed": 3}})
    b = run(SEED_A_LAYERS, x, y, options={"hvp": {"vector": "random", "seed": 3}})
    assert torch.equal(T(a.hvp["0.weight"]), T(b.hvp["0.weight"]))


# --- per-example gradients ---------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_sample_gradients_and_norms_equal_a_local_loop(reduction):
    x, y = seed_a_batch(5)
    r = run(SEED_A_LAYERS, x, y, loss={"type": "cross_entropy", "reduction": reduction},
            options={"per_sample": "full"})
    model = seed_a_module()
    norms = []
    for i in range(5):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction=reduction).backward()
        sq = 0.0
        for n, p in model.named_parameters():
            assert close(T(r.per_sample.gradients[n])[i], p.grad), (i, n)
            sq += float(p.grad.pow(2).sum())
        norms.append(sq ** 0.5)
    assert close(T(r.per_sample.norms), torch.tensor(norms, dtype=torch.float64))


def test_per_sample_norms_only_omit_the_gradients():
    x, y = seed_a_batch(3)
    r = run(SEED_A_LAYERS, x, y, options={"per_sample": "norms"})
    assert r.per_sample.gradients is None and T(r.per_sample.norms).shape == (3,)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_sample_without_the_batch_gradient_gives_the_same_norms_and_loss_and_checks_their_sum(reduction):
    x, y = seed_a_batch(5)
    loss = {"type": "cross_entropy", "reduction": reduction}
    with_batch = run(SEED_A_LAYERS, x, y, loss=loss, options={"per_sample": "norms"})
    r = run(SEED_A_LAYERS, x, y, loss=loss, options={"per_sample": "norms", "batch_gradient": False,
                                                       "numcheck": "exact"})
    assert close(T(r.per_sample.norms), T(with_batch.per_sample.norms))
    assert r.loss == pytest.approx(with_batch.loss, rel=1e-12, abs=0)
    assert all(g is None for g in r.gradients.values()) and r.memory is None and r.timings.forward_ms == 0
    assert r.numcheck.mode == "exact" and r.numcheck.passed  # the examples' gradients summed, against float64


@pytest.mark.parametrize("options", [{}, {"per_sample": "norms", "input_grad": True},
                                     {"per_sample": "norms", "hvp": {"vector": "random"}},
                                     {"per_sample": "norms", "micro_batch": 2}])
def test_no_batch_gradient_is_refused_with_nothing_to_compute_or_a_batch_quantity(options):
    x, y = seed_a_batch(3)
    with pytest.raises(SpecError) as e:
        estimate(msgspec.convert({"model": {"layers": SEED_A_LAYERS, "dtype": "float64"}, "inputs": tensor_json(x),
                                  "targets": tensor_json(y),
                                  "options": {"batch_gradient": False, **options}}, GradientRequest))
    assert e.value.code == "bad_option" and "batch_gradient" in str(e.value)


def test_per_sample_is_refused_with_batch_norm_in_training_mode():
    x, y = seed_a_batch(4)
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "BatchNorm1d", "num_features": 8},
              {"type": "Linear", "in_features": 8, "out_features": 3}]
    with pytest.raises(SpecError) as info:
        run(layers, x, y, options={"per_sample": "norms"})
    assert info.value.code == "bad_option" and "layer 1 (BatchNorm1d)" in info.value.message


BATCH_NORM_NET = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "BatchNorm1d", "num_features": 8},
                  {"type": "Tanh"}, {"type": "Linear", "in_features": 8, "out_features": 3}]


@pytest.mark.parametrize("micro_batch", [1, 2, 3])
def test_micro_batch_is_refused_with_batch_norm_in_training_mode_before_anything_runs(micro_batch):
    x, y = seed_a_batch(4)
    body = {"model": {"layers": BATCH_NORM_NET, "dtype": "float64"}, "inputs": tensor_json(x),
            "targets": tensor_json(y), "options": {"micro_batch": micro_batch}}
    req = msgspec.convert(body, GradientRequest)
    for device in ("meta", "cpu"):  # the API's check on meta, and the worker's
        with pytest.raises(SpecError) as info:
            prepare(req, EngineConfig(), device)
        assert info.value.code == "bad_option", info.value.message
        assert "layer 1 (BatchNorm1d)" in info.value.message and "micro_batch" in info.value.message
        assert info.value.detail == {"layer": "1", "option": "micro_batch"}


def test_a_micro_batch_as_large_as_the_batch_is_exact_with_batch_norm():
    x, y = seed_a_batch(4)
    whole = run(BATCH_NORM_NET, x, y, options={"numcheck": "off"})
    one_chunk = run(BATCH_NORM_NET, x, y, options={"numcheck": "exact", "micro_batch": 4})
    assert one_chunk.micro_batches == 1 and one_chunk.numcheck.passed
    for name in whole.gradients:
        assert torch.equal(T(whole.gradients[name]), T(one_chunk.gradients[name])), name


# --- micro-batch accumulation ------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("micro_batch", [1, 3, 4])
def test_micro_batches_accumulate_to_the_full_batch_gradient(reduction, micro_batch):
    x, y = seed_a_batch(8)
    loss = {"type": "cross_entropy", "reduction": reduction}
    full = run(SEED_A_LAYERS, x, y, loss=loss)
    micro = run(SEED_A_LAYERS, x, y, loss=loss, options={"micro_batch": micro_batch})
    assert micro.micro_batches == -(-8 // micro_batch)
    for n in full.gradients:
        assert close(T(micro.gradients[n]), T(full.gradients[n])), n
    assert micro.loss == pytest.approx(full.loss, abs=1e-12)


def test_micro_batches_report_lower_activation_memory():
    x = torch.randn(64, 32, dtype=torch.float64)
    layers = wide_stack_layers(4, 32)
    full = run(layers, x, x, loss="mse")
    micro = run(layers, x, x, loss="mse", options={"micro_batch": 16})
    assert micro.memory.saved_bytes_total * 4 == full.memory.saved_bytes_total


# --- frozen parameters -------------------------------------------------------------------------------
def test_frozen_parameters_get_no_gradient_and_autograd_skips_them():
    x, y = seed_a_batch()
    r = run(SEED_A_LAYERS, x, y, options={"freeze": ["0"], "numcheck": "exact"})
    assert r.gradients["0.weight"] is None and r.gradients["0.bias"] is None
    model = seed_a_module()
    for p in model[0].parameters():
        p.requires_grad_(False)
    F.cross_entropy(model(x), y).backward()
    assert close(T(r.gradients["2.weight"]), model[2].weight.grad)
    assert set(r.numcheck.per_parameter) == {"2.weight", "2.bias"}
    assert r.numcheck.evaluations == 2 * (24 + 3)
    names = [n.name for n in run(SEED_A_LAYERS, x, y, options={"freeze": ["0"], "graph": True}).graph]
    assert names.count("AccumulateGrad") == 2  # only layer 2's weight and bias are leaves of the graph


def test_freeze_prefix_that_matches_nothing_is_refused():
    x, y = seed_a_batch()
    with pytest.raises(SpecError) as info:
        run(SEED_A_LAYERS, x, y, options={"freeze": ["7"]})
    assert info.value.code == "bad_option" and "'7'" in info.value.message


# --- checkpointing: memory for time ------------------------------------------------------------------
def test_checkpointed_depth_16_mlp_saves_at_least_half_the_memory_with_equal_gradients():
    x = torch.randn(64, 128, dtype=torch.float64)
    layers = wide_stack_layers(16, 128)
    plain = run(layers, x, x, loss="mse")
    ckpt = run(layers, x, x, loss="mse", options={"checkpoint_segments": 4})
    for n in plain.gradients:
        assert close(T(ckpt.gradients[n]), T(plain.gradients[n])), n
    assert ckpt.memory.saved_bytes_total * 2 <= plain.memory.saved_bytes_total
    assert ckpt.checkpoint["saved_bytes_without"] == plain.memory.saved_bytes_total
    assert ckpt.checkpoint["memory_saved_bytes"] == plain.memory.saved_bytes_total - ckpt.memory.saved_bytes_total
    assert ckpt.checkpoint["forward_backward_ms_with"] > 0


# --- the grad_fn chain -------------------------------------------------------------------------------
def test_graph_walks_the_grad_fn_chain_of_seed_004s_mlp():
    layers = [{"type": "Linear", "in_features": 784, "out_features": 128}, {"type": "ReLU"},
              {"type": "Linear", "in_features": 128, "out_features": 10}]
    x, y = torch.randn(4, 784, dtype=torch.float64), torch.tensor([1, 2, 3, 4])
    graph = run(layers, x, y, options={"graph": True}).graph
    by_id = {node.id: node for node in graph}
    chain, node = [], graph[0]
    while True:
        chain.append(node.name)
        nxt = [by_id[i] for i in node.next if by_id[i].name not in ("AccumulateGrad", "TBackward0")]
        if not nxt:
            break
        node = nxt[0]
    assert chain == ["NllLossBackward0", "LogSoftmaxBackward0", "AddmmBackward0", "ReluBackward0", "AddmmBackward0"]
    assert sum(node.name == "AccumulateGrad" for node in graph) == 4


# --- numerical check modes ---------------------------------------------------------------------------
def test_auto_check_on_a_million_parameters_takes_at_most_64_evaluations_and_passes():
    layers = [{"type": "Linear", "in_features": 1000, "out_features": 1000}, {"type": "Tanh"},
              {"type": "Linear", "in_features": 1000, "out_features": 10}]
    x, y = torch.randn(8, 1000, dtype=torch.float64), torch.randint(0, 10, (8,))
    r = run(layers, x, y, options={"numcheck": "auto"})
    assert r.parameter_count > 1_000_000
    assert r.numcheck.mode in ("sampled", "directional")  # exact (2M evaluations) never fits the budget
    assert r.numcheck.evaluations <= 64
    assert r.numcheck.passed and r.numcheck.max_rel_error < 1e-6


def test_dropout_is_deterministic_across_numcheck_evaluations():
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Dropout", "p": 0.5},
              {"type": "Tanh"}, {"type": "Linear", "in_features": 8, "out_features": 3}]
    x, y = seed_a_batch()
    r = run(layers, x, y, options={"numcheck": "exact"})
    assert r.numcheck.passed and r.numcheck.max_rel_error < 1e-6


# --- estimate on the meta device ---------------------------------------------------------------------
CNN = [{"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3, "padding": 1}, {"type": "ReLU"},
       {"type": "MaxPool2d", "kernel_size": 2}, {"type": "Conv2d", "in_channels": 4, "out_channels": 8,
                                                 "kernel_size": 3}, {"type": "BatchNorm2d", "num_features": 8},
       {"type": "GELU"}, {"type": "Flatten"}, {"type": "Linear", "in_features": 8 * 2 * 2, "out_features": 3}]
RESIDUAL = [{"type": "Linear", "in_features": 6, "out_features": 16},
            {"type": "Residual", "layers": [{"type": "LayerNorm", "normalized_shape": 16},
                                            {"type": "Linear", "in_features": 16, "out_features": 16},
                                            {"type": "Sigmoid"}]},
            {"type": "Residual", "layers": [{"type": "Linear", "in_features": 16, "out_features": 16},
                                            {"type": "LeakyReLU", "negative_slope": 0.1}]},
            {"type": "Linear", "in_features": 16, "out_features": 3}]


@pytest.mark.parametrize("layers, shape", [(SEED_A_LAYERS, (4, 6)), (CNN, (4, 1, 8, 8)), (RESIDUAL, (4, 6))])
def test_estimate_equals_the_measured_memory(layers, shape):
    x, y = torch.randn(*shape, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    body = {"model": {"layers": layers, "dtype": "float64"}, "inputs": tensor_json(x), "targets": tensor_json(y),
            "options": {"numcheck": "off"}}
    req = msgspec.convert(body, GradientRequest)
    predicted, measured = estimate(req), compute(req)
    assert predicted.memory == msgspec.structs.replace(measured.memory, device_peak_bytes=None)
    assert predicted.parameter_count == measured.parameter_count


def test_cnn_and_residual_gradients_equal_local_modules():
    x, y = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    r = run(CNN, x, y)
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3),
                        nn.BatchNorm2d(8), nn.GELU(), nn.Flatten(), nn.Linear(32, 3)).double()
    F.cross_entropy(cnn(x), y).backward()
    for n, p in cnn.named_parameters():
        assert close(T(r.gradients[n]), p.grad), n
    x = torch.randn(4, 6, dtype=torch.float64)
    r = run(RESIDUAL, x, y)
    torch.manual_seed(0)
    res = nn.Sequential(nn.Linear(6, 16), Residual(nn.LayerNorm(16), nn.Linear(16, 16), nn.Sigmoid()),
                        Residual(nn.Linear(16, 16), nn.LeakyReLU(0.1)), nn.Linear(16, 3)).double()
    F.cross_entropy(res(x), y).backward()
    for n, p in res.named_parameters():
        assert close(T(r.gradients[n]), p.grad), n


def test_timing_repeat_reports_medians_and_the_same_gradients():
    x, y = seed_a_batch()
    once = run(SEED_A_LAYERS, x, y)
    many = run(SEED_A_LAYERS, x, y, options={"timing_repeat": 5})
    assert torch.equal(T(once.gradients["0.weight"]), T(many.gradients["0.weight"]))
    assert many.timings.forward_ms > 0 and many.timings.backward_ms > 0
