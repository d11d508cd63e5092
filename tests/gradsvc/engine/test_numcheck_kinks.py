"""What the check does where a finite difference cannot be trusted as it stands: a kink (the one-sided
differences disagree), a value the loss detaches on purpose or computes under torch.no_grad() (held at its
unperturbed point), a float32
loss large beside its gradient (the returned tolerance follows the arithmetic); and that a planted error
at any of them still fails, naming the tensor."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from gradsvc.engine import EngineConfig, compute
from gradsvc.engine.numcheck import tolerances
from gradsvc.engine.numcheck.run import CheckRun, run
from gradsvc.wire import GradientRequest
from tests.support.nets import tensor_json


def _relu_at_its_kink():
    """loss = sum(relu(W x + b)) with W x + b exactly 0 for unit 0 of every row: each element of W[0] and b[0]
    sits on ReLU's kink; unit 1 is smooth (positive)."""
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU()).double()
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[0.5, -0.25], [0.75, 0.5]]))
        net[0].bias.copy_(torch.tensor([0.0, 0.25]))
    x = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)  # 0.5 x - 0.25 y = 0 on both rows
    params = dict(net.named_parameters())

    def loss_fn():
        return net(x).sum()

    grads = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))
    return params, loss_fn, grads


def test_an_element_on_a_kink_is_judged_kink_and_left_out_not_failed():
    params, loss_fn, grads = _relu_at_its_kink()
    check = run(CheckRun("exact", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8, directions=4, seed=0))
    assert check.passed, check.per_parameter
    weight, bias = check.per_parameter["0.weight"], check.per_parameter["0.bias"]
    assert weight.kinks == 2 and bias.kinks == 1 and check.kinks == 3  # row 0 of W, b[0]
    assert weight.judged == "ratio" and bias.judged == "ratio"  # row 1 and b[1] are smooth and right
    assert check.max_rel_error < 1e-8  # the kinks' 0.5 is left out of the headline


def test_a_wrong_gradient_on_a_kink_still_fails():
    params, loss_fn, grads = _relu_at_its_kink()
    grads["0.bias"] = grads["0.bias"].clone()
    grads["0.bias"][0] = -1.0  # ReLU's one-sided derivatives at 0 are 0 and 1: -1 is neither
    check = run(CheckRun("exact", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8, directions=4, seed=0))
    assert not check.passed and check.per_parameter["0.bias"].judged == "failed"


def test_a_straddled_kink_is_re_differenced_at_a_smaller_step():
    """relu(w - 3e-7): the kink is 3e-7 from w, inside eps=1e-6 but outside eps/10: resolved, no kink."""
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    params = {"w": w}

    def loss_fn():
        return torch.relu(w - 3e-7).sum() + 2 * w.sum()

    grads = {"w": torch.autograd.grad(loss_fn(), [w])[0]}
    check = run(CheckRun("exact", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8, directions=4, seed=0))
    assert check.passed and check.kinks == 0 and check.max_rel_error < 1e-8, check.per_parameter


def test_a_direction_across_a_kink_is_judged_kink_and_a_check_of_kinks_alone_says_nothing_was_checked():
    params, loss_fn, grads = _relu_at_its_kink()
    check = run(CheckRun("directional", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8,
                         directions=8, seed=0))
    assert check.kinks == 8  # every direction moves row 0's pre-activation off 0: no direction compared
    assert check.passed is None and "nothing was checked" in check.reason, check.reason
    check = run(CheckRun("exact", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8, directions=8, seed=0))
    assert check.passed is True and check.reason == ""  # element by element, unit 1's are compared


def test_a_wrong_gradient_among_kinks_is_never_passed_in_directions_and_fails_element_by_element():
    """Every direction crosses the kinks at the point: a wrong gradient there cannot be told from them along a
    direction (never `true`); element by element, b[1] (smooth) fails."""
    params, loss_fn, grads = _relu_at_its_kink()
    grads["0.bias"] = grads["0.bias"] * 3  # b[1] wrong where the function is smooth
    check = run(CheckRun("directional", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8,
                         directions=8, seed=0))
    assert check.passed is not True
    check = run(CheckRun("exact", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8, directions=8, seed=0))
    assert check.passed is False and check.per_parameter["0.bias"].judged == "failed"


class ZeroInitResidual(nn.Module):
    """A residual block whose last norm starts at zero (timm's zero_init_last): relu(block(x) + x) with the block
    giving exactly 0, so every ReLU whose shortcut is 0 sits at its kink, read downstream through weights of both
    signs: along a direction, convex and concave kinks at once."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        nn.init.zeros_(self.block.weight)
        nn.init.zeros_(self.block.bias)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(torch.relu(self.block(h) + h))


def test_directions_across_kinks_of_both_signs_at_the_point_are_kinks_and_a_planted_error_elsewhere_fails():
    torch.manual_seed(0)
    net = ZeroInitResidual().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    params = dict(net.named_parameters())

    def loss_fn():
        return torch.nn.functional.cross_entropy(net(x), torch.tensor([0, 1, 2, 0, 1]))

    grads = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))
    check = run(CheckRun("directional", params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8,
                         directions=8, seed=0))
    assert check.passed is not False and check.kinks > 0, check.reason
    wrong = {**grads, "out.bias": grads["out.bias"] * 1.5}  # the output bias: smooth, element by element it fails
    check = run(CheckRun("sampled", params, loss_fn, wrong, eps=1e-6, tolerance=1e-6, samples=8, directions=8,
                         seed=0))
    assert check.passed is False and check.per_parameter["out.bias"].judged == "failed"


def _detached_body(**options) -> dict:
    from gradclient.export import export_graph
    from gradclient.tensors import to_wire
    from tests.support.check_cases import VERDICT_CASES

    model, inputs, _, loss = VERDICT_CASES["policy_gradient_baseline"]()
    eg = export_graph(model.double(), tuple(a.double() if a.is_floating_point() else a for a in inputs))
    return {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": [to_wire(a.double() if a.is_floating_point() else a) for a in inputs], "loss": loss,
            "options": {"numcheck": "exact", **options}}


def test_a_deliberately_detached_value_is_held_and_the_right_gradient_passes():
    body = _detached_body()
    check = compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest), EngineConfig()).numcheck
    assert check.passed, {n: (p.judged, p.max_rel_error) for n, p in check.per_parameter.items()}
    assert check.held == ["node 'detach' (aten.detach.default)"]
    assert check.max_rel_error < 1e-6


def test_holding_detached_values_keeps_a_wrong_op_inside_failing(monkeypatch):
    """The same loss with the policy's gradient scaled 1.5x inside (a custom Function on its logits)."""
    from gradclient.export import export_graph
    from gradclient.tensors import to_wire
    from tests.support.check_cases import planted

    (model, inputs, _, loss), name = planted("policy_gradient_baseline", "scaled")
    inputs = tuple(a.double() if a.is_floating_point() else a for a in inputs)
    eg = export_graph(model.double(), inputs)
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": [to_wire(a) for a in inputs], "loss": loss, "options": {"numcheck": "exact"}}
    check = compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest), EngineConfig()).numcheck
    assert not check.passed and check.per_parameter[name].judged == "failed" and check.held


def _no_grad_check(name: str, planted_error: str | None = None):
    """VERDICT_CASES[name] (a loss computing part of itself under torch.no_grad()) checked in float64, exact;
    with `planted_error`, that error planted (check_cases.planted). (check, the planted tensor's name)."""
    from gradclient.export import export_graph
    from gradclient.tensors import to_wire
    from tests.support.check_cases import VERDICT_CASES, planted

    (model, inputs, _, loss), weight = planted(name, planted_error) if planted_error else (VERDICT_CASES[name](), "")
    model = model.double()
    inputs = tuple(a.double() if a.is_floating_point() else a for a in inputs)
    eg = export_graph(model, inputs)
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": [to_wire(a) for a in inputs], "loss": loss, "options": {"numcheck": "exact"}}
    return compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest), EngineConfig()).numcheck, weight


def test_values_computed_under_no_grad_are_held_and_the_right_gradient_passes():
    check, _ = _no_grad_check("dqn_target_network")
    assert check.passed, {n: (p.judged, p.max_rel_error) for n, p in check.per_parameter.items()}
    # The target network's nodes are held (not only the detaches of the values entering the region)...
    assert {h for h in check.held if "in module 'target." in h} == {
        "node 'linear_2' (aten.linear.default) in module 'target.0' (Linear)",
        "node 'tanh_1' (aten.tanh.default) in module 'target.1' (Tanh)",
        "node 'linear_3' (aten.linear.default) in module 'target.2' (Linear)"}, check.held
    # ... and the online network's are not: it is checked element by element, the target network's gradient is 0.
    assert not any("in module 'q." in h for h in check.held), check.held
    assert all(check.per_parameter[n].judged == "ratio" for n in check.per_parameter if n.startswith("q."))
    assert all(check.per_parameter[n].judged == "zero" for n in check.per_parameter if n.startswith("target."))


def test_an_ema_teacher_updated_under_no_grad_is_checked_element_by_element():
    """The teacher's buffers move towards the student at every forward: were the check's evaluations to move
    them again, each finite difference would measure the drift (every element read as a kink before)."""
    check, _ = _no_grad_check("ema_teacher")
    assert check.passed and check.kinks == 0, {n: (p.judged, p.kinks) for n, p in check.per_parameter.items()}
    assert {p.judged for p in check.per_parameter.values()} == {"ratio"}
    assert check.max_rel_error < 1e-6


class _EMAPull(nn.Module):
    """A student pulled towards an EMA of its own weight: the EMA buffer is updated in place under no_grad, then
    read by a term that has a gradient (the held update's value is the buffer itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(6, 4)
        self.register_buffer("ema", torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(self.student.weight, alpha=0.1)
        return self.student(x).pow(2).mean() + ((self.student.weight - self.ema) ** 2).sum()


def test_a_buffer_updated_under_no_grad_and_read_with_a_gradient_keeps_its_updated_value():
    from gradclient.export import export_graph
    from gradclient.tensors import to_wire

    torch.manual_seed(0)
    model, x = _EMAPull().double(), torch.randn(8, 6, dtype=torch.float64)
    eg = export_graph(model, (x,))
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "loss": "output", "options": {"numcheck": "exact"}}
    check = compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest), EngineConfig()).numcheck
    assert check.passed and check.kinks == 0, {n: (p.judged, p.max_rel_error) for n, p in check.per_parameter.items()}
    assert any("aten.add_.Tensor" in h for h in check.held), check.held


@pytest.mark.parametrize("name", ["dqn_target_network", "ema_teacher"])
def test_holding_no_grad_values_keeps_a_wrong_op_failing(name):
    check, weight = _no_grad_check(name, "scaled")
    failed = {n for n, p in check.per_parameter.items() if p.judged == "failed"}
    assert not check.passed and weight in failed, (weight, failed)
    assert not any(n.startswith("target.") for n in failed), failed  # the held target network is not blamed


def _regression(weights_scale: float = 1.0, **options):
    from tests.support.check_cases import regression_near_its_fit

    model, (x,), y, loss = regression_near_its_fit()
    weights = {n: tensor_json(p.detach() * weights_scale) for n, p in model.named_parameters()}
    weights = {"0." + n: w for n, w in weights.items()}
    body = {"model": {"layers": [{"type": "Linear", "in_features": 8, "out_features": 1}], "dtype": "float32",
                      "weights": weights}, "inputs": tensor_json(x), "targets": tensor_json(y), "loss": loss,
            "options": {"numcheck": "exact", **options}}
    return compute(msgspec.convert(body, GradientRequest), EngineConfig())


def test_a_float32_loss_near_1e5_passes_on_right_gradients_by_its_arithmetic():
    result = _regression()
    check = result.numcheck
    assert 9e4 < result.loss < 2e5
    assert check.passed, {n: (p.returned_judged, p.returned_max_rel_error, p.returned_tolerance)
                          for n, p in check.per_parameter.items()}
    # float32 lost more than its fixed 1e-4 here, and the tolerance says how much it could
    assert check.returned_max_rel_error > tolerances.returned_tolerance(torch.float32)
    assert check.returned_max_rel_error < check.returned_tolerance <= tolerances.ARITHMETIC_MAX


def test_a_wrong_gradient_of_a_small_loss_fails_at_the_dtype_tolerance():
    ref = {"w": torch.tensor([0.3, -1.2, 2.5], dtype=torch.float64)}
    params = {"w": torch.tensor([1.0, 0.5, -0.5], dtype=torch.float64)}
    rounded = {"w": ref["w"] * (1 + 1e-7)}  # a small loss: rounding moves the gradient by float32's own
    own = tolerances.arithmetic_tolerances(torch.float32, ref, rounded)
    assert own == {"w": tolerances.returned_tolerance(torch.float32)}
    wrong = tolerances.returned_check({"w": (ref["w"] * 1.001).float()}, ref, torch.float32, tolerances=own)
    assert not wrong.passed and wrong.judged["w"] == "failed"
    assert params  # the parameters do not enter the rule: only what rounding does to the gradient


@pytest.mark.parametrize("error", ["scaled", "sign_flipped"])
def test_the_large_loss_with_a_wrong_gradient_still_fails(error):
    from gradclient.export import export_graph
    from gradclient.tensors import to_wire
    from tests.support.check_cases import planted

    (model, inputs, y, loss), name = planted("regression_loss_1e5", error)
    eg = export_graph(model, inputs)
    body = {"model": {"graph": eg.graph, "dtype": "float32", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(inputs[0]), "targets": to_wire(y), "loss": loss}
    check = compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest), EngineConfig()).numcheck
    assert not check.passed and check.per_parameter[name].judged == "failed"


class _DuplicateSelfLoops(nn.Module):
    """torch_geometric's add_remaining_self_loops on a graph with two self-loops at one node: each loop's weight is
    written to the node with a plain index_put, and one of the two writes wins."""

    def __init__(self) -> None:
        super().__init__()
        self.edge = nn.Linear(2, 1)

    def forward(self, edge_attr: torch.Tensor) -> torch.Tensor:
        weight = self.edge(edge_attr).squeeze(-1)  # (edges,)
        loops = torch.tensor([1, 1, 2])  # the nodes of the self-loops: node 1 twice
        return weight.new_ones(3).index_put((loops,), weight).unsqueeze(0)


def test_index_put_onto_a_repeated_index_gets_torchs_gradient_and_the_check_says_it_is_not_the_derivative():
    """The service answers PyTorch's own gradient, and the check (float64 central differences) fails it, rightly:
    autograd gives each write to a repeated index the output's gradient, where only the write that won moved the
    output (torch_geometric's PDNConv on a random graph, docs/models.md)."""
    from gradclient.export import export_graph
    from gradclient.tensors import from_wire, to_wire

    torch.manual_seed(0)
    model, edge_attr = _DuplicateSelfLoops().double(), torch.rand(3, 2, dtype=torch.float64)
    eg = export_graph(model, (edge_attr,))
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(edge_attr), "targets": to_wire(torch.tensor([1])), "loss": "cross_entropy",
            "options": {"numcheck": "exact"}}
    result = compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest), EngineConfig())
    torch.nn.functional.cross_entropy(model(edge_attr), torch.tensor([1])).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(from_wire(result.gradients[name]), p.grad, rtol=1e-12, atol=1e-15), name
    assert result.numcheck.passed is False
    assert result.numcheck.per_parameter["edge.weight"].judged == "failed"


def _sharp(scale: float = 1.0):
    """loss = sum(1e-8 tanh(1e8 w) * [1, 2]) + sum(u^2) at w = 0: smooth everywhere, its gradient of order 1, but
    curving over a width of 1e-8 in w (as a BatchNorm over two values curves where they nearly meet): the central
    difference along w is tanh(h / 1e-8) 1e-8 / h, 0.01, 0.1 and 0.76 of the derivative at h = eps = 1e-6, 1e-7
    and 1e-8, still moving; both one-sided slopes are below the derivative (no kink); u is smooth. `scale`:
    autograd's gradient of w multiplied (1: right)."""
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    u = torch.tensor([0.5, -1.5, 2.0], dtype=torch.float64, requires_grad=True)
    params = {"w": w, "u": u}

    def loss_fn():
        return (1e-8 * torch.tanh(1e8 * w) * torch.tensor([1.0, 2.0], dtype=torch.float64)).sum() + (u * u).sum()

    grads = dict(zip(params, torch.autograd.grad(loss_fn(), [w, u])))
    grads["w"] = grads["w"] * scale
    return params, loss_fn, grads


@pytest.mark.parametrize("mode", ["exact", "directional"])
def test_differences_still_moving_at_the_smallest_step_are_unsettled_not_a_failure_of_a_right_gradient(mode):
    """A right gradient where the loss curves faster than float64 differences resolve: each offending element
    (or direction) is differenced at eps/10 and eps/100 and still moves, so it is not judged, and the check says
    it cannot pass (null), never that a right gradient failed."""
    params, loss_fn, grads = _sharp()
    check = run(CheckRun(mode, params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8, directions=4, seed=0))
    assert check.passed is None and "still moving" in check.reason, (check.passed, check.reason)
    if mode == "exact":
        assert check.per_parameter["w"].judged == "unsettled" and check.per_parameter["u"].judged == "ratio"


@pytest.mark.parametrize("mode", ["exact", "directional"])
def test_a_wrong_gradient_is_never_passed_where_differences_are_unsettled_and_fails_where_they_settle(mode):
    """The same loss: autograd's gradient of w 1.5x is at most not judged (null) where the differences do not
    settle; a wrong gradient of the smooth u next to it fails element by element, and in directions (each moving w
    too, so none settles) is not passed."""
    params, loss_fn, grads = _sharp(scale=1.5)
    check = run(CheckRun(mode, params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8, directions=4, seed=0))
    assert check.passed is None
    params, loss_fn, grads = _sharp()
    grads["u"] = grads["u"] * 1.5
    check = run(CheckRun(mode, params, loss_fn, grads, eps=1e-6, tolerance=1e-6, samples=8, directions=4, seed=0))
    assert check.passed is (False if mode == "exact" else None)
    if mode == "exact":
        assert check.per_parameter["u"].judged == "failed" and check.per_parameter["w"].judged == "unsettled"
