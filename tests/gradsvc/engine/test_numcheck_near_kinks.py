"""A ReLU input within float32's rounding of its kink: float32 puts it on the other side than float64, so the
float32 gradient takes the other branch's slope there and differs from float64's by a whole term, which no margin
over a simulated rounding covers. The check finds the elements within rounding's reach of a kink, measures what
their other branch does to the gradient, and passes the right float32 gradient (local float32 autograd's) while a
planted error still fails."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import from_wire, to_wire
from gradsvc.engine import EngineConfig, compute
from gradsvc.engine.numcheck import near_kinks, tolerances
from gradsvc.wire import GradientRequest

from tests.support.check_cases import Scaled


class Gated(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.w, self.b, self.v = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4)), nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (F.relu(x * self.w + self.b, inplace=self.inplace) * self.v).sum(1)


def _at_the_kink(seed: int) -> tuple[Gated, torch.Tensor, torch.Tensor]:
    """40 rows; row 0's first pre-activation is x * w + b with b = -float32(x * w): exactly 0 in float32 (the
    ReLU's gradient 0 there), a positive rounding residual in float64 (its gradient 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 4, generator=g)
    w, b = torch.randn(4, generator=g), torch.randn(4, generator=g) * 0.1
    while True:
        x0, w0 = torch.randn(2, generator=g)
        if float(x0.double() * w0.double()) > float((x0 * w0).double()):  # float32 rounded the product down
            break
    x[0, 0], w[0], b[0] = x0, w0, -(x0 * w0)
    model = Gated(inplace=False)
    with torch.no_grad():
        model.w.copy_(w), model.b.copy_(b), model.v.copy_(torch.randn(4, generator=g))
    return model, x, torch.randn(40, generator=g)


def _request(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> GradientRequest:
    eg = export_graph(model, (x,))
    body = {"model": {"graph": eg.graph, "dtype": "float32", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "mse", "options": {"numcheck": "exact"}}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_relu_input_within_rounding_of_its_kink_passes_the_float32_gradient_and_a_planted_error_fails(seed, inplace):
    model, x, y = _at_the_kink(seed)
    model.inplace = inplace
    local = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    m64 = Gated(inplace).double()
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    exact = torch.autograd.grad(F.mse_loss(m64(x.double()), y.double()), list(m64.parameters()))
    off = float((local[1].double() - exact[1]).abs().max() / exact[1].abs().max())
    assert off > 1e-3, off  # float32 took the other branch at row 0: its bias gradient is a whole term off

    result = compute(_request(model, x, y), EngineConfig())
    check = result.numcheck
    for (n, _), want in zip(model.named_parameters(), local):
        torch.testing.assert_close(from_wire(result.gradients[n]), want)  # what float32 autograd computes
    assert check.passed is True, {n: (p.returned_judged, p.returned_max_rel_error, p.returned_tolerance)
                                  for n, p in check.per_parameter.items()}
    # widened to what the other branch does, not to the ceiling: the tensors the kink does not reach keep theirs
    assert off < check.per_parameter["b"].returned_tolerance < tolerances.ARITHMETIC_MAX
    assert check.per_parameter["v"].returned_tolerance < 1e-3

    returned = {n: from_wire(g).double() for n, g in result.gradients.items()}
    own = {n: p.returned_tolerance for n, p in check.per_parameter.items()}
    for name, factor in (("b", 1.5), ("b", -1.0), ("v", 1.01)):
        wrong = dict(returned, **{name: returned[name] * factor})
        r = tolerances.returned_check(wrong, returned, torch.float32, tolerances=own)
        assert not r.passed and r.judged[name] == "failed", (name, factor)


def test_the_kinks_of_each_piecewise_op_by_its_arguments():
    x = torch.zeros(3)
    assert near_kinks.kinks_of("aten.relu_.default", (x,), {}) == [0.0]
    assert near_kinks.kinks_of("aten.leaky_relu.default", (x, 0.1), {}) == [0.0]
    assert near_kinks.kinks_of("aten.hardtanh.default", (x,), {}) == [-1.0, 1.0]
    assert near_kinks.kinks_of("aten.hardtanh_.default", (x, 0.0, 6.0), {}) == [0.0, 6.0]
    assert near_kinks.kinks_of("aten.clamp.default", (x, None, 2.0), {}) == [2.0]
    assert near_kinks.kinks_of("aten.clamp.Tensor", (x, x), {}) is None
    assert near_kinks.kinks_of("aten.threshold.default", (x, 0.5, 0.0), {}) == [0.5]
    assert near_kinks.kinks_of("aten.hardsigmoid.default", (x,), {}) == [-3.0, 3.0]
    assert near_kinks.kinks_of("aten.tanh.default", (x,), {}) is None


class ZeroInitialised(nn.Module):
    """A bias initialised to zero added to a ReLU's output, then a ReLU: every input of the second ReLU where the
    first read a negative value is exactly at its kink (timm's zero-initialised last norms in BoTNet and HaloNet)."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.wrong = wrong
        self.a, self.b, self.c = nn.Linear(8, 16, bias=False), nn.Parameter(torch.zeros(16)), nn.Linear(16, 3)

    def forward(self, x):
        b = Scaled.apply(self.b) if self.wrong else self.b
        return self.c(torch.relu(torch.relu(self.a(x)) + b))


@pytest.mark.parametrize("mode", ["directional", "exact"])
@pytest.mark.parametrize("seed", [0, 1])
def test_inputs_exactly_at_a_kink_are_judged_on_autograds_branch_and_a_wrong_backward_fails(mode, seed):
    """A difference across an input exactly at a ReLU's kink measures the mean of its branches (1/2) where autograd
    takes one (0): every direction through the zero bias was a kink, and the check judged nothing there (passed
    null). Held on autograd's branch, those inputs are judged: the right gradient passes, one 1.5x fails."""
    for wrong, passed in ((False, True), (True, False)):
        torch.manual_seed(seed)
        model = ZeroInitialised(wrong).double()
        x, y = torch.randn(32, 8, dtype=torch.float64), torch.randint(0, 3, (32,))
        eg = export_graph(model, (x,))
        body = {"model": {"graph": eg.graph, "dtype": "float64",
                          "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
                "inputs": to_wire(x), "targets": to_wire(y), "loss": "cross_entropy", "options": {"numcheck": mode}}
        result = compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest), EngineConfig())
        want = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), want):
            torch.testing.assert_close(from_wire(result.gradients[n]), g)  # the hold leaves autograd's as it is
        assert result.numcheck.passed is passed and result.numcheck.kinks == 0, (wrong, result.numcheck)
