"""Gradient diagnostics through the live stack: the SDK and plain HTTP against a real Redis and RQ worker,
each quantity against its answer key (BackPACK, clip_grad_norm_, Opacus's definition, an exact Hessian)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.gradsvc.engine.test_diagnostics import (CNN_LAYERS, TinyTransformer, assert_close, batch_grads, cnn,
                                                   cnn_batch, exact_hessian, noise_scale_formula, opacus_step,
                                                   per_example_grads)
from tests.support.nets import from_wire


@pytest.fixture()
def client(stack):
    with stack.sdk_client() as c:
        yield c


def test_sdk_returns_norms_backpack_statistics_clipping_and_curvature(client):
    from backpack import backpack, extend
    from backpack.extensions import SumGradSquared, Variance

    module, (x, y) = cnn(), cnn_batch()
    result = client.gradients(module, x, y, numcheck="off", diagnostics=["norms", "variance", "second_moment"],
                              clip={"max_norm": 0.05}, curvature={"top": 2, "trace": True, "probes": 30,
                                                                  "tolerance": 1e-8, "seed": 1})
    local = extend(copy.deepcopy(module))
    with backpack(Variance(), SumGradSquared()):
        extend(nn.CrossEntropyLoss())(local(x), y).backward()
    assert_close(result.diagnostics.variance, {n: p.variance for n, p in local.named_parameters()}, 1e-10)
    assert_close(result.diagnostics.second_moment, {n: p.sum_grad_squared for n, p in local.named_parameters()},
                 1e-10)
    total = torch.nn.utils.clip_grad_norm_(local.parameters(), 0.05)
    assert result.diagnostics.norms.global_ == pytest.approx(float(total), rel=1e-12)
    assert result.clip.total_norm == pytest.approx(float(total), rel=1e-12)
    assert_close(result.gradients, {n: p.grad for n, p in local.named_parameters()}, 1e-12)
    exact = torch.linalg.eigvalsh(exact_hessian(module, x, y)).flip(0)
    assert result.curvature.top_eigenvalues == pytest.approx(exact[:2].tolist(), rel=1e-6)
    assert abs(result.curvature.trace - float(exact.sum())) <= 4 * result.curvature.trace_stderr
    samples = result.curvature.trace_samples  # each probe's z^T H z, their mean the trace
    assert len(samples) == 30 and result.curvature.trace == pytest.approx(sum(samples) / 30, rel=1e-12)


def test_sdk_graph_model_gets_per_example_clipping_and_the_noise_scale(client):
    torch.manual_seed(0)
    module = TinyTransformer().eval()
    g = torch.Generator().manual_seed(2)
    ids, y = torch.randint(0, 10, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)
    result = client.gradients(module, ids, y, numcheck="off", diagnostics=["norms", "noise_scale"],
                              clip={"max_norm": 0.5, "per_sample": True})
    per_example = per_example_grads(module, ids, y)
    want = batch_grads(module, ids, y)
    assert result.diagnostics.norms.parameters == pytest.approx({k: float(v.norm()) for k, v in want.items()},
                                                                rel=1e-4)
    _, s, g2 = noise_scale_formula({k: v.double() for k, v in per_example.items()})
    assert (result.diagnostics.noise_scale.trace_covariance,
            result.diagnostics.noise_scale.gradient_norm_squared) == pytest.approx((s, g2), rel=1e-4, abs=1e-6)
    want_clipped = opacus_step(per_example, 0.5)
    scale = max(float(v.abs().max()) for v in want_clipped.values())
    for k, v in want_clipped.items():
        assert float((result.gradients[k] - v).abs().max()) <= 1e-4 * scale, k
    assert result.clip.examples == 8


def test_http_json_carries_the_contract_field_names(http):
    module, (x, y) = cnn(), cnn_batch()
    body = {"model": {"layers": CNN_LAYERS, "dtype": "float64",
                      "weights": {k: {"dtype": "float64", "shape": list(v.shape), "data": v.tolist()}
                                  for k, v in module.state_dict().items()}},
            "inputs": x.tolist(), "targets": y.tolist(), "loss": "cross_entropy",
            "options": {"numcheck": "off", "diagnostics": ["norms", "second_moment", "noise_scale"],
                        "clip": {"max_norm": 2.2, "per_sample": True},
                        "curvature": {"top": 1, "density": True, "probes": 3, "iterations": 10}}}
    r = http.post("/gradients", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    norms = got["diagnostics"]["norms"]
    assert set(norms) == {"global", "parameters", "modules"} and set(norms["modules"]) == {"0", "3"}
    assert set(got["diagnostics"]) == {"norms", "second_moment", "noise_scale"}
    share = {k: v / 6 for k, v in per_example_grads(module, x, y).items()}
    assert_close({k: from_wire(v) for k, v in got["diagnostics"]["second_moment"].items()},
                 {k: (v ** 2).sum(0) for k, v in share.items()}, 1e-10)
    assert set(got["diagnostics"]["noise_scale"]) >= {"b_simple", "trace_covariance", "gradient_norm_squared"}
    assert got["clip"]["examples"] == 6 and 0 < got["clip"]["clipped"] < 6
    curvature = got["curvature"]
    assert curvature["matrix"] == "hessian" and len(curvature["top_eigenvalues"]) == 1
    assert sum(curvature["density"]["weights"]) == pytest.approx(1.0)
    assert curvature["products"] > 30


def test_http_refuses_more_eigenvalues_than_parameters_with_422_bad_option(http):
    x, y = cnn_batch()
    body = {"model": {"layers": CNN_LAYERS, "dtype": "float64"}, "inputs": x.tolist(), "targets": y.tolist(),
            "options": {"curvature": {"top": 500}}}
    r = http.post("/gradients", json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_option" and "at most 96" in error["message"]
