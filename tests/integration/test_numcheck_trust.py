"""The numerical check through the SDK, the API, Redis and a real worker: with the default options it
passes on the zoo of real models (BERT, ViT, GPT-2 over every position, Llama, ConvNeXt, a ResNet block
with BatchNorm, a U-Net skip, a MobileNet squeeze-excite block, ...) within its budget, and it fails,
naming the parameter, for custom autograd Functions whose backward is wrong or is not the derivative."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F


from tests.support.models import CASES

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("case", list(CASES))
def test_default_check_passes_on_every_zoo_model(client, case):
    model, x, y, loss = CASES[case](torch.float32)
    result = client.gradients(model, x, y, loss=loss)  # numcheck "auto"
    check = result.numcheck
    assert check.passed, (check.mode, {n: (p.judged, p.max_rel_error, p.returned_judged)
                                       for n, p in check.per_parameter.items()})
    assert check.reason.startswith(f"auto chose {check.mode}")
    assert check.mode == "directional" or all(p.judged in ("ratio", "floor", "zero")
                                              for p in check.per_parameter.values())


class Doubling(torch.autograd.Function):
    """y = 2x, its backward written by hand."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class WrongScale(torch.autograd.Function):
    """y = 2x, with a backward 1.5 x the derivative."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 3 * g


class WrongSign(torch.autograd.Function):
    """tanh with the sign of its derivative flipped."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return -g * (1 - y * y)


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Wrapped(nn.Module):
    def __init__(self, fn: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.first = nn.Linear(4, 5)
        self.last = nn.Linear(5, 3)
        self.fn = fn

    def forward(self, x):
        return self.last(self.fn.apply(self.first(x)))


@pytest.mark.parametrize("fn, passes", [(Doubling, True), (WrongScale, False), (WrongSign, False),
                                        (StraightThrough, False)], ids=["right", "scaled", "sign", "ste"])
def test_a_custom_backward_is_judged_and_a_wrong_one_named(client, fn, passes):
    torch.manual_seed(0)
    model = Wrapped(fn).double()
    x, y = 2 * torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    result = client.gradients(copy.deepcopy(model), x, y)  # the default check
    check = result.numcheck
    assert check.passed is passes, check.per_parameter
    verdicts = {n: p.judged for n, p in check.per_parameter.items()}
    if passes:
        assert "failed" not in verdicts.values()
    else:  # the layer before the Function gets the wrong gradient; the one after is right
        assert verdicts["first.weight"] == "failed" and verdicts["last.weight"] != "failed", verdicts
    # Whatever the check says, the service returned the Function's own backward, as local autograd does.
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert torch.allclose(torch.as_tensor(result.gradients["first.weight"]), model.first.weight.grad, atol=1e-10)


def test_every_returned_quantity_is_checked_through_the_service(client):
    model, x, y, loss = CASES["prenorm_block"](torch.float64)
    result = client.gradients(model, x, y, loss=loss, hvp={"vector": "random"}, input_grad=True,
                              per_sample="norms")
    q = result.numcheck.quantities
    assert set(q) == {"hvp", "input_gradient", "per_sample"}, q
    assert all(c.passed for c in q.values()) and result.numcheck.passed, q


def _one_verdict(check) -> tuple:
    return (check.mode, check.evaluations, check.cut, tuple(check.held), check.passed,
            tuple((n, p.checked, p.judged, p.kinks) for n, p in sorted(check.per_parameter.items())))


@pytest.mark.parametrize("name", ["mnist_cnn", "policy_gradient_baseline", "dqn_target_network"])
def test_one_request_gets_one_verdict_and_a_planted_error_is_named_through_the_service(client, name):
    from tests.support.check_cases import VERDICT_CASES, local_gradients, planted

    def send(case):
        model, inputs, targets, loss = case
        return client.gradients(model, inputs[0] if len(inputs) == 1 else inputs, targets, loss=loss).numcheck

    checks = [send(VERDICT_CASES[name]()) for _ in range(2)]  # numcheck "auto"
    assert checks[0].passed, (checks[0].reason, {n: (p.judged, p.max_rel_error) for n, p in checks[0].per_parameter.items()})
    assert _one_verdict(checks[0]) == _one_verdict(checks[1])
    assert checks[0].budget_evaluations > 0 and "auto chose" in checks[0].reason
    if name == "policy_gradient_baseline":  # the advantage is detached on purpose: held, not failed
        assert checks[0].held == ["node 'detach' (aten.detach.default)"]
    if name == "dqn_target_network":  # the target network runs under no_grad on purpose: held, not failed
        assert any("in module 'target.2'" in h for h in checks[0].held), checks[0].held
    case, weight = planted(name, "scaled")
    check = send(case)
    failed = {n for n, p in check.per_parameter.items() if p.judged == "failed"}
    clean, wrong = local_gradients(VERDICT_CASES[name]()), local_gradients(case)
    assert not check.passed and failed, check.reason
    assert all(not torch.allclose(wrong[n], clean[n]) for n in failed), failed  # it names wrong tensors only
    assert check.mode != "exact" or weight in failed
