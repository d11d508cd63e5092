"""The numerical check's pass rule on real models: right gradients pass (attention's exactly-zero key bias,
a bias in front of BatchNorm, a gradient one float32 rounding off), planted errors fail naming the tensor,
and each returned quantity (hvp, input_gradient, per_sample, per-loss) is checked on its own."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc.engine import EngineConfig, compute
from gradsvc.engine import quantities
from gradsvc.engine.numcheck import plan as planning
from gradsvc.engine.numcheck import tolerances
from gradsvc.engine.numcheck.run import CheckRun, run
from gradsvc.wire import GradientRequest

from tests.support.models import CASES
from tests.support.nets import SEED_A_LAYERS, seed_a_batch, tensor_json


def graph_request(case: str, dtype=torch.float32, **options) -> GradientRequest:
    model, x, y, loss = CASES[case](dtype)
    eg = export_graph(model, (x,))
    body = {"model": {"graph": eg.graph, "dtype": str(dtype).removeprefix("torch."),
                      "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": loss, "options": options}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def test_attention_key_bias_is_judged_zero_and_bert_passes_exact():
    check = compute(graph_request("hf_bert", numcheck="exact"), EngineConfig()).numcheck
    assert check.passed, {n: (p.judged, p.returned_judged) for n, p in check.per_parameter.items()}
    key_bias = next(n for n in check.per_parameter if n.endswith("attention.self.key.bias"))
    assert check.per_parameter[key_bias].judged == "zero"  # softmax is shift-invariant: exactly zero
    assert check.per_parameter[key_bias].returned_judged == "zero"
    # The headline leaves zero and floor tensors out: what is left are errors relative to real scales.
    judged = [p for p in check.per_parameter.values() if p.judged in ("ratio", "failed")]
    assert check.max_rel_error == max(p.max_rel_error for p in judged) < check.tolerance
    assert check.returned_max_rel_error < check.returned_tolerance


def test_a_bias_in_front_of_batch_norm_is_zero_not_a_hundred_percent_error():
    check = compute(graph_request("mobilenet_se", torch.float64, numcheck="exact"), EngineConfig()).numcheck
    assert check.passed
    bias = check.per_parameter["depthwise.bias"]
    assert bias.judged == "zero" and bias.returned_judged == "zero"
    assert check.max_rel_error < 1e-6  # not the 1.0 of noise over noise


def _seed_a_check(**options):
    x, y = seed_a_batch()
    req = msgspec.convert({"model": {"layers": SEED_A_LAYERS, "dtype": "float64"}, "inputs": tensor_json(x),
                           "targets": tensor_json(y), "options": {"numcheck": "exact", **options}}, GradientRequest)
    return compute(req, EngineConfig())


def _run(mode: str, edit):
    """The check (numcheck.run.run) on the 6-8-3 tanh net in float64 with the autograd gradients edited by `edit`."""
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = seed_a_batch()
    x = x.double()
    params = dict(net.named_parameters())

    def loss_fn():
        return nn.functional.cross_entropy(net(x), y)

    grads = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))
    edit(grads)
    return run(CheckRun(mode, params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=4, directions=16, seed=0))


@pytest.mark.parametrize("mode", ["exact", "sampled"])
def test_planted_errors_fail_naming_the_tensor_and_one_rounding_passes(mode):
    def scale(g):
        g["0.weight"] = g["0.weight"] * 1.5

    def sign(g):
        g["2.bias"] = -g["2.bias"]

    def ulp(g):  # every gradient one float32 rounding off: right, as a float32 answer is
        for n in g:
            g[n] = g[n] * (1 + 2.0 ** -23)

    for edit, name in ((scale, "0.weight"), (sign, "2.bias")):
        check = _run(mode, edit)
        assert not check.passed and check.per_parameter[name].judged == "failed", check.per_parameter
        assert all(p.judged != "failed" for n, p in check.per_parameter.items() if n != name)
    assert _run(mode, ulp).passed


def test_planted_error_along_directions_fails():
    check = _run("directional", lambda g: g.__setitem__("0.weight", g["0.weight"] * 1.5))
    assert not check.passed


def test_the_returned_check_passes_one_float32_rounding_and_fails_a_wrong_tensor():
    ref = {"a": torch.tensor([0.3, -1.2, 2.5], dtype=torch.float64), "b": torch.tensor([1e-22, -3e-23],
                                                                                      dtype=torch.float64)}
    got = {"a": ref["a"].float(), "b": torch.tensor([2e-9, -1e-9])}  # float32 noise on a zero gradient
    r = tolerances.returned_check(got, ref, torch.float32)
    assert r.passed and r.judged == {"a": "ratio", "b": "zero"} and r.max_rel_error < 1e-7
    bad = tolerances.returned_check({**got, "a": got["a"] * 1.01}, ref, torch.float32)
    assert not bad.passed and bad.judged["a"] == "failed"


def test_every_returned_quantity_is_checked_and_a_wrong_one_fails():
    from torch import nn

    result = _seed_a_check(hvp={"vector": "random"}, input_grad=True, per_sample="full",
                           numcheck_samples=4)
    q = result.numcheck.quantities
    assert set(q) == {"hvp", "input_gradient", "per_sample"} and all(c.passed for c in q.values()), q
    assert result.numcheck.passed
    several = msgspec.convert({"model": {"layers": SEED_A_LAYERS, "dtype": "float32"},
                               "inputs": tensor_json(seed_a_batch()[0]), "targets": {"y": tensor_json(seed_a_batch()[1])},
                               "losses": [{"name": "a", "type": "cross_entropy", "target": "y"},
                                          {"name": "b", "type": "cross_entropy", "target": "y", "weight": 0.5,
                                           "reduction": "sum"}]}, GradientRequest)
    check = compute(several, EngineConfig()).numcheck
    assert check.quantities["per_loss"].passed and check.passed
    # A wrong H v is caught by the differences of gradients along v.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = seed_a_batch()
    params = dict(net.named_parameters())

    def loss_fn():
        return nn.functional.cross_entropy(net(x.double()), y)

    v = {n: torch.randn_like(p) for n, p in params.items()}
    g = torch.autograd.grad(loss_fn(), list(params.values()), create_graph=True)
    hv = dict(zip(params, torch.autograd.grad(g, list(params.values()), grad_outputs=list(v.values()))))
    assert quantities.hvp(params, loss_fn, v, hv, 1e-6, 1e-6).passed
    wrong = {**hv, "0.weight": hv["0.weight"] * 1.1}
    assert not quantities.hvp(params, loss_fn, v, wrong, 1e-6, 1e-6).passed


def test_auto_plans_within_its_budget_and_says_why():
    plan = planning.plan_auto([48, 8, 24, 3], 1000, exact_max=20_000, samples=8, directions=16)
    assert plan.mode == "exact" and "166 evaluations" in plan.reason and plan.cut == ""
    big = [1_000_000, 1000, 10_000, 10]
    sampled = planning.plan_auto(big, 100, exact_max=20_000, samples=8, directions=16)
    assert (sampled.mode, sampled.samples, sampled.cut) == ("sampled", 8, "")
    fewer = planning.plan_auto(big, 40, exact_max=20_000, samples=8, directions=16)
    assert fewer.mode == "sampled" and fewer.samples == 5 and "cut from 8 to 5" in fewer.cut  # 2 x 4 x 5 fit
    tight = planning.plan_auto(big, 10, exact_max=20_000, samples=8, directions=16)
    assert tight.mode == "directional" and tight.directions == 5 and "cut from 16 to 5" in tight.cut
    check = compute(graph_request("hf_bert", numcheck="auto"), EngineConfig()).numcheck
    assert check.reason.startswith("auto chose") and check.mode in check.reason and check.passed
    assert check.budget_evaluations > 0 and check.evaluations <= check.budget_evaluations + 1  # + the base loss


def test_gradients_returned_in_a_smaller_dtype_are_judged_at_its_tolerance():
    result = _seed_a_check(numcheck="exact", gradient_dtype="bfloat16")
    assert all(g.dtype == "bfloat16" for g in result.gradients.values())
    check = result.numcheck
    assert check.returned_tolerance >= tolerances.returned_tolerance(torch.bfloat16) and check.passed
    assert check.returned_max_rel_error > 1e-4  # bfloat16's rounding shows, within its own tolerance


def test_a_step_float64_cannot_resolve_fails_the_check_and_says_why():
    check = _seed_a_check(numcheck="exact", numcheck_eps=5e-324).numcheck
    assert not check.passed and "too small for float64" in check.reason
    assert check.rounding_floor < float("inf")  # JSON has no infinity
    assert _seed_a_check(numcheck="exact", numcheck_eps=1e-6).numcheck.passed
