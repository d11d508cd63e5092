"""A run's step as the worker computes it (workers/run_steps.py), against torch on the same tensors: the global and
per-module gradient norms, the update ratio per module, and what a step keeps of the weights for the next one."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from gradsvc.broker.runs import RunBounds
from gradsvc.engine import tensors
from gradsvc.wire import GradientRequest, GradientResult, Timings
from workers.run_steps import gradient_norms, module_of, step_of, update_ratios


def test_module_of_is_the_parent_path_and_a_root_parameter_is_its_own_module():
    assert module_of("0.weight") == "0"
    assert module_of("blocks.1.attn.in_proj_weight") == "blocks.1.attn"
    assert module_of("pos") == "pos"


def test_gradient_norms_are_torchs_clip_grad_norm_total_and_each_modules_norm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    model(torch.randn(3, 5)).sum().backward()
    grads = {n: p.grad.double().flatten().numpy() for n, p in model.named_parameters()}
    total, modules = gradient_norms(grads)
    assert total == pytest.approx(float(nn.utils.clip_grad_norm_(model.parameters(), float("inf"))), rel=1e-6)
    for index in ("0", "2"):
        layer = model[int(index)]
        want = torch.cat([layer.weight.grad.flatten(), layer.bias.grad.flatten()]).double().norm()
        assert modules[index] == pytest.approx(float(want), rel=1e-12)


def test_update_ratio_is_the_modules_step_size_over_its_previous_weights_after_an_optimizer_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(8, 4)).pow(2).mean().backward()
    torch.optim.Adam(model.parameters(), lr=0.01).step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    ratios = update_ratios({n: w.double().flatten().numpy() for n, w in before.items()},
                           {n: w.double().flatten().numpy() for n, w in after.items()})
    for index in ("0", "2"):
        names = [f"{index}.weight", f"{index}.bias"]
        moved = torch.cat([(after[n] - before[n]).flatten() for n in names]).double().norm()
        size = torch.cat([before[n].flatten() for n in names]).double().norm()
        assert ratios[index] == pytest.approx(float(moved / size), rel=1e-12)


def _request(weights: dict[str, torch.Tensor]) -> GradientRequest:
    return msgspec.convert({"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}],
                                      "weights": {n: msgspec.to_builtins(tensors.encode(w))
                                                  for n, w in weights.items()}},
                            "inputs": [[0.0, 1.0]], "run": {"name": "exp", "step": 3}}, GradientRequest)


class DiagnosedResult(GradientResult):
    """A result as the diagnostics options make it (options.diagnostics, options.clip)."""

    diagnostics: dict | None = None
    clip: dict | None = None


def _result(cls=GradientResult, **extra) -> GradientResult:
    grads = {"0.weight": torch.tensor([[3.0, 0.0], [0.0, 0.0]]), "0.bias": torch.tensor([0.0, 4.0])}
    return cls(device="cpu", dtype="float32", parameter_count=6, torch_version="", loss=0.5,
               gradients={n: tensors.encode(g) for n, g in grads.items()}, timings=Timings(total_ms=2.0), **extra)


def test_a_step_compares_its_weights_with_the_previous_steps_and_keeps_its_own_for_the_next():
    w0 = {"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2)}
    w1 = {"0.weight": torch.full((2, 2), 1.5), "0.bias": torch.ones(2)}
    first, kept = step_of(_request(w0), _result(), "job-0", None, RunBounds())
    assert first.update_ratio is None and first.grad_norm == 5.0 and first.module_grad_norms == {"0": 5.0}
    assert first.step == 3 and first.loss == 0.5 and first.total_ms == 2.0
    second, _ = step_of(_request(w1), _result(), "job-1", kept, RunBounds())
    moved = torch.cat([(w1[n] - w0[n]).flatten() for n in w0]).double().norm()
    want = float(moved / torch.cat([w0[n].flatten() for n in w0]).double().norm())  # sqrt(3) / 2
    assert second.update_ratio == {"0": pytest.approx(want, rel=1e-12)}


def test_a_model_over_the_weights_bound_keeps_no_weights_and_records_no_ratio():
    w = {"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2)}
    bounds = RunBounds(weights_max_bytes=23)  # the model takes 24
    _, kept = step_of(_request(w), _result(), "job-0", None, bounds)
    assert kept == b""


def test_noise_scale_and_clip_are_recorded_when_the_result_carries_them():
    plain, _ = step_of(_request({}), _result(), "job-0", None, RunBounds())
    assert plain.noise_scale is None and plain.clip is None
    result = _result(DiagnosedResult, diagnostics={"noise_scale": {"b_simple": 12.5}},
                     clip={"total_norm": 5.0, "scale": 0.2})
    diagnosed, _ = step_of(_request({}), result, "job-0", None, RunBounds())
    assert diagnosed.noise_scale == 12.5 and diagnosed.clip == {"total_norm": 5.0, "scale": 0.2}
