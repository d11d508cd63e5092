"""Models the numerical check must judge right with its default options, as their authors write them: the
MNIST example's CNN (ReLU, max-pool, dropout in eval), a BatchNorm ResNet block and a squeeze-excite block in
training mode, a float32 regression near its least-squares fit (loss near 1e5, gradient small beside it),
losses that detach part of themselves on purpose (a policy gradient's baseline, a VQ-VAE's commitment) or
compute part of themselves under torch.no_grad() (a DQN's target network, an EMA teacher), and
the zoo's transformers; and the same models with a planted error (a custom Function whose backward is
wrong on one module's output), which the check must fail, naming that module's parameters.

Each entry of VERDICT_CASES builds (model, inputs, targets, loss) like tests/support/models.py's CASES
(whose ResNet, SE, and transformer entries it reuses); inputs is a tuple of the forward's arguments."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from tests.support.models import CASES


class MnistNet(nn.Module):
    """pytorch/examples' mnist/main.py Net, as written there (eval mode: its dropouts are off)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)  # (batch, 64, 12, 12)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)  # (batch, 10)


class PolicyWithBaseline(nn.Module):
    """REINFORCE with a learned baseline: the advantage is detached so that the policy's loss does not
    train the baseline, which its own squared error trains. Returns the loss."""

    def __init__(self, obs: int = 6, actions: int = 4) -> None:
        super().__init__()
        self.body = nn.Linear(obs, 16)
        self.policy = nn.Linear(16, actions)
        self.value = nn.Linear(16, 1)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(obs))  # (batch, 16)
        logp = F.log_softmax(self.policy(h), dim=-1).gather(1, actions[:, None]).squeeze(1)  # (batch,)
        value = self.value(h).squeeze(1)  # (batch,)
        advantage = (returns - value).detach()
        return -(logp * advantage).mean() + 0.5 * F.mse_loss(value, returns)


class VectorQuantizer(nn.Module):
    """A VQ-VAE bottleneck (van den Oord et al.): nearest code, the codebook and commitment losses with
    their stop-gradients, the straight-through estimator, and a decoder's reconstruction. Returns the loss."""

    def __init__(self, dim: int = 4, codes: int = 8, beta: float = 0.25) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, dim)
        self.codebook = nn.Embedding(codes, dim)
        self.decoder = nn.Linear(dim, 6)
        self.beta = beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)  # (batch, dim)
        codes = self.codebook.weight
        distances = (z * z).sum(1, keepdim=True) - 2 * z @ codes.T + (codes * codes).sum(1)  # (batch, codes)
        index = distances.argmin(1)  # (batch,)
        q = self.codebook(index)  # (batch, dim)
        vq = F.mse_loss(q, z.detach()) + self.beta * F.mse_loss(z, q.detach())
        q = z + (q - z).detach()  # straight through
        return F.mse_loss(self.decoder(q), x) + vq


class DQNTarget(nn.Module):
    """A DQN's temporal-difference loss: the online network's Q of the action taken against a target computed
    under torch.no_grad() by a target network (the max over its next-state Q), which the loss does not train.
    Returns the loss."""

    def __init__(self, obs: int = 6, actions: int = 4, gamma: float = 0.9) -> None:
        super().__init__()
        self.q = nn.Sequential(nn.Linear(obs, 16), nn.Tanh(), nn.Linear(16, actions))
        self.target = nn.Sequential(nn.Linear(obs, 16), nn.Tanh(), nn.Linear(16, actions))
        self.gamma = gamma

    def forward(self, obs: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor,
                next_obs: torch.Tensor) -> torch.Tensor:
        q = self.q(obs).gather(1, actions[:, None]).squeeze(1)  # (batch,)
        with torch.no_grad():
            target = rewards + self.gamma * self.target(next_obs).max(1).values  # (batch,)
        return F.mse_loss(q, target)


class EMATeacher(nn.Module):
    """A mean teacher (BYOL-style): the teacher's weights are buffers, an exponential moving average of the
    student's, updated in place under torch.no_grad() before the teacher labels a second view; the student
    learns the teacher's soft labels. Returns the loss."""

    def __init__(self, features: int = 6, classes: int = 4, decay: float = 0.9) -> None:
        super().__init__()
        self.student = nn.Linear(features, classes)
        self.register_buffer("teacher_weight", torch.randn(classes, features))
        self.register_buffer("teacher_bias", torch.zeros(classes))
        self.decay = decay

    def forward(self, x: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.teacher_weight.mul_(self.decay).add_(self.student.weight, alpha=1 - self.decay)
            self.teacher_bias.mul_(self.decay).add_(self.student.bias, alpha=1 - self.decay)
            soft = F.softmax(F.linear(view, self.teacher_weight, self.teacher_bias), -1)  # (batch, classes)
        return -(soft * F.log_softmax(self.student(x), -1)).sum(-1).mean()


def regression_near_its_fit() -> tuple[nn.Module, tuple, torch.Tensor, dict]:
    """A float32 linear regression of prices near 300 with its least-squares weights (fitted in float64)
    nudged: a summed squared error near 1e5 whose gradient, a sum of 256 residuals x inputs that nearly
    cancel, float32 rounds to a relative 1e-3."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g, dtype=torch.float64) * 3 + 10
    y = x @ (torch.randn(8, 1, generator=g, dtype=torch.float64) * 20) + 300
    y = y + 20 * torch.randn(256, 1, generator=g, dtype=torch.float64)
    fit = torch.linalg.lstsq(torch.cat([x, torch.ones(256, 1, dtype=torch.float64)], 1), y).solution
    model = nn.Linear(8, 1).double()
    with torch.no_grad():
        model.weight.copy_(fit[:8].T + 1e-4 * torch.randn(1, 8, generator=g, dtype=torch.float64))
        model.bias.copy_(fit[8])
    return model.float(), (x.float(),), y.float(), {"type": "mse", "reduction": "sum"}


Case = tuple[nn.Module, tuple, "torch.Tensor | None", "str | dict"]


def _zoo(name: str) -> Callable[[], Case]:
    def make() -> Case:
        model, x, y, loss = CASES[name](torch.float32)
        return model, (x,), y, loss
    return make


def _mnist() -> Case:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return MnistNet().eval(), (torch.randn(2, 1, 28, 28, generator=g),), torch.tensor([3, 7]), "nll"


def _policy() -> Case:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    obs, actions = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    return PolicyWithBaseline(), (obs, actions, torch.randn(8, generator=g)), None, "output"


def _vq() -> Case:
    torch.manual_seed(0)
    return VectorQuantizer(), (torch.randn(8, 6, generator=torch.Generator().manual_seed(1)),), None, "output"


def _dqn() -> Case:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g), torch.randn(8, generator=g),
              torch.randn(8, 6, generator=g))
    return DQNTarget(), inputs, None, "output"


def _ema() -> Case:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return EMATeacher(), (torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)), None, "output"


VERDICT_CASES: dict[str, Callable[[], Case]] = {
    "mnist_cnn": _mnist,
    "resnet_block_batchnorm": _zoo("resnet_block"),
    "squeeze_excite": _zoo("mobilenet_se"),
    "regression_loss_1e5": regression_near_its_fit,
    "policy_gradient_baseline": _policy,
    "vq_vae_commitment": _vq,
    "dqn_target_network": _dqn,
    "ema_teacher": _ema,
    **{name: _zoo(name) for name in ("prenorm_block", "transformer_encoder", "hf_llama", "hf_bert",
                                      "hf_gpt2_every_position", "hf_vit")},
}

# The module whose output a planted error wraps, per case: its parameters get the wrong gradient.
PLANT_AT = {
    "mnist_cnn": "fc2", "resnet_block_batchnorm": "head", "squeeze_excite": "head", "regression_loss_1e5": "",
    "policy_gradient_baseline": "policy", "vq_vae_commitment": "decoder", "dqn_target_network": "q.2",
    "ema_teacher": "student", "prenorm_block": "head",
    "transformer_encoder": "head", "hf_llama": "lm.lm_head", "hf_bert": "bert.classifier",
    "hf_gpt2_every_position": "lm.lm_head", "hf_vit": "vit.classifier",
}


class Scaled(torch.autograd.Function):
    """The identity, its backward 1.5 x the derivative."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return 1.5 * g


class Flipped(torch.autograd.Function):
    """The identity, its backward's sign flipped."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return -g


class OneWrong(torch.autograd.Function):
    """The identity, its backward wrong in the first element only (twice its value plus 1e-2)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        first = torch.zeros_like(g).flatten()
        first[0] = 1.0
        first = first.view_as(g)
        return g + first * (g + 1e-2)


PLANTED = {"scaled": Scaled, "sign_flipped": Flipped, "one_wrong_element": OneWrong}


def planted(case: str, error: str) -> tuple[Case, str]:
    """VERDICT_CASES[case] with PLANTED[error] on PLANT_AT[case]'s output, and the name of that module's
    weight (under its first name where it is tied, as state_dict and the service name it)."""
    model, inputs, targets, loss = VERDICT_CASES[case]()
    module = model.get_submodule(PLANT_AT[case])
    module.register_forward_hook(lambda _m, _args, out: PLANTED[error].apply(out))
    name = next(n for n, p in model.named_parameters() if p is module.weight)
    return (model, inputs, targets, loss), name


def wire_body(case: Case, dtype: str = "float32", **options) -> dict:
    """The POST /gradients body of `case`, its model exported by the SDK as a graph."""
    from gradclient.export import export_graph
    from gradclient.tensors import to_wire

    model, inputs, targets, loss = case
    eg = export_graph(model, inputs)
    body = {"model": {"graph": eg.graph, "dtype": dtype, "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(inputs[0]) if len(inputs) == 1 else [to_wire(a) for a in inputs], "loss": loss,
            "options": options}
    if targets is not None:
        body["targets"] = to_wire(targets)
    return body


def local_gradients(case: Case) -> dict[str, torch.Tensor]:
    """The answer key: eager autograd of `case` on a copy of its model."""
    import copy

    model, inputs, targets, loss = case
    model = copy.deepcopy(model)
    out = model(*inputs)
    if loss == "output":
        value = out
    elif isinstance(loss, dict):
        value = F.mse_loss(out, targets, reduction=loss["reduction"])
    else:
        value = {"nll": F.nll_loss, "cross_entropy": F.cross_entropy, "mse": F.mse_loss}[loss](out, targets)
    params = dict(model.named_parameters())
    # materialize_grads: a parameter the loss does not train (a target network) has a zero gradient
    return dict(zip(params, torch.autograd.grad(value, list(params.values()), materialize_grads=True)))
