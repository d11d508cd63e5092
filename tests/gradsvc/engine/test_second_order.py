"""A loss with a gradient inside it, as its authors write it (`torch.autograd.grad(..., create_graph=True)` in
forward): a WGAN-GP critic's penalty, an eikonal loss, a PINN's Laplacian residual and a second-order (MAML) inner
step, captured by the SDK (torch.export cannot take autograd.grad, so the recording does) and computed by the
engine: the gradients equal local autograd's in float64 (1e-10) and float32, through tanh, sigmoid, softplus,
leaky ReLU and ReLU, on several batches; the numerical check passes them. Once the recording dropped the
second-order terms through an activation's saved output (a constant where autograd unpacks it again), answered
gradients 7e-2 off, and the check, judging the recording against itself, passed them."""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc.engine import Engine, EngineConfig
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest

ACTIVATIONS = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "softplus": nn.Softplus, "leaky_relu": nn.LeakyReLU,
               "relu": nn.ReLU}


class Critic(nn.Module):
    """WGAN-GP: the critic's loss on real and generated rows, with the gradient penalty on their interpolates."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), ACTIVATIONS[act](), nn.Linear(16, 16), ACTIVATIONS[act](),
                                 nn.Linear(16, 1))

    def forward(self, real, fake, alpha):
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)  # (batch, 4)
        score = self.net(mixed)  # (batch, 1)
        grad, = torch.autograd.grad(score.sum(), mixed, create_graph=True)
        penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        return self.net(fake).mean() - self.net(real).mean() + 10.0 * penalty


class Eikonal(nn.Module):
    """A signed distance field: |f| on surface points and |grad_x f| = 1 everywhere."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), ACTIVATIONS[act](), nn.Linear(16, 16), ACTIVATIONS[act](),
                                 nn.Linear(16, 1))

    def forward(self, points):
        points = points.clone().requires_grad_(True)  # (batch, 3)
        f = self.net(points)  # (batch, 1)
        grad, = torch.autograd.grad(f, points, grad_outputs=torch.ones_like(f), create_graph=True)
        return f.abs().mean() + 0.1 * ((grad.norm(dim=-1) - 1.0) ** 2).mean()


class Laplacian(nn.Module):
    """A PINN's residual of u'' = -sin(x) in one dimension: a second derivative of the output by the input."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), ACTIVATIONS[act](), nn.Linear(16, 1))

    def forward(self, x):
        x = x.clone().requires_grad_(True)  # (batch, 1)
        u = self.net(x)
        du, = torch.autograd.grad(u.sum(), x, create_graph=True)
        d2u, = torch.autograd.grad(du.sum(), x, create_graph=True)
        return ((d2u + torch.sin(x)) ** 2).mean()


class InnerStep(nn.Module):
    """MAML: one SGD step on the support rows with create_graph=True, the loss of the stepped weights on the query
    rows; the gradient goes through the inner step (second order)."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(2, 16), nn.Linear(16, 1)
        self.act = ACTIVATIONS[act]()

    def _forward(self, x, w):
        return F.linear(self.act(F.linear(x, w[0], w[1])), w[2], w[3])

    def forward(self, support, query):
        weights = [self.hidden.weight, self.hidden.bias, self.out.weight, self.out.bias]
        inner = F.mse_loss(self._forward(support[:, :2], weights), support[:, 2:])
        grads = torch.autograd.grad(inner, weights, create_graph=True)
        stepped = [w - 0.1 * g for w, g in zip(weights, grads)]
        return F.mse_loss(self._forward(query[:, :2], stepped), query[:, 2:])


def _case(kind: str, act: str, seed: int):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(100 + seed)
    if kind == "wgan_gp":
        n = 6 + seed
        return Critic(act), (torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g) + 0.5,
                             torch.rand(n, 1, generator=g))
    if kind == "eikonal":
        return Eikonal(act), (torch.randn(5 + seed, 3, generator=g),)
    if kind == "laplacian":
        return Laplacian(act), (torch.linspace(-2, 2, 7 + seed).unsqueeze(1),)
    return InnerStep(act), (torch.randn(5 + seed, 3, generator=g), torch.randn(4, 3, generator=g))


def _local(model: nn.Module, inputs: tuple, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model).to(dtype)
    loss = m(*(x.to(dtype) for x in inputs))
    params = dict(m.named_parameters())
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()), materialize_grads=True)))


def _computed(model: nn.Module, inputs: tuple, dtype: str, numcheck: str):
    eg = export_graph(model, inputs)
    body = {"model": {"graph": eg.graph, "dtype": dtype, "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": [to_wire(x) for x in inputs] if len(inputs) > 1 else to_wire(inputs[0]), "loss": "output",
            "options": {"numcheck": numcheck}}
    request = msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)
    return eg.capture, Engine(EngineConfig()).compute(request)


CASES = [(kind, act) for kind in ("wgan_gp", "eikonal", "laplacian", "inner_step")
         for act in ("tanh", "sigmoid", "softplus", "leaky_relu", "relu")
         if not (kind == "laplacian" and act in ("relu", "leaky_relu"))]  # a piecewise-linear u has u'' = 0


# A second batch and weights for each case in `make test-all` (the first covers every kind and activation).
SEEDS = [0, pytest.param(1, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind, act", CASES)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_gradient_inside_the_loss_equals_local_autograd_in_float64(kind, act, seed):
    model, inputs = _case(kind, act, seed)
    capture, result = _computed(model.double(), tuple(x.double() for x in inputs), "float64", "exact")
    assert capture == "trace"
    want = _local(model, inputs, torch.float64)
    for name, g in want.items():
        got = decode(result.gradients[name], where=name, max_elements=1 << 20)
        torch.testing.assert_close(got, g, rtol=1e-10, atol=1e-10 * max(float(g.abs().max()), 1e-30))
    assert result.numcheck.passed is True, result.numcheck.reason


@pytest.mark.parametrize("kind", ["wgan_gp", "eikonal", "laplacian", "inner_step"])
def test_a_gradient_inside_the_loss_in_float32_is_float32_autograds(kind):
    model, inputs = _case(kind, "tanh", 0)
    _, result = _computed(model, inputs, "float32", "auto")
    want64 = _local(model, inputs, torch.float64)
    want32 = _local(model, inputs, torch.float32)
    for name, g in want64.items():
        got = decode(result.gradients[name], where=name, max_elements=1 << 20).double()
        allowance = 4 * float((want32[name].double() - g).abs().max()) + 1e-6 * float(g.abs().max())
        assert float((got - g).abs().max()) <= allowance, name
    assert result.numcheck.passed is True, result.numcheck.reason
