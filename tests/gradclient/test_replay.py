"""A recording is verified before it is sent: replayed on the batch, its outputs equal the module's, and with
verify=True its gradients too; a recording that lost a dependency (the second-order terms through an activation's
saved output, as the recording once lost them) is refused with a reason, and the module, its buffers and the RNG
are left as they were."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from gradclient.errors import UnsupportedModuleError
from gradclient.export import export_graph
from gradclient.replay import verify_recording


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        x = self.bn(x).requires_grad_(True)
        grad, = torch.autograd.grad(self.net(x).sum(), x, create_graph=True)
        return self.net(x).mean() + ((grad.norm(dim=1) - 1) ** 2).mean() + 0.1 * torch.randn(()).abs()


def _recorded():
    torch.manual_seed(0)
    model, x = Critic(), torch.randn(6, 4)
    return model, x, export_graph(model, (x,)).traced


def _losing_the_saved_output(traced):
    """The recording as it was when it wrote an activation's saved output down as a detached copy."""
    tanh = next(c.name for c in traced.calls if c.name.startswith("tanh") and "backward" not in c.name)
    detached = next(c.name for c in traced.calls if c.func is torch.ops.aten.detach.default
                    and c.args[0] == ("node", tanh))
    calls = [dataclasses.replace(c, args=tuple(("node", detached) if a == ("node", tanh) else a for a in c.args))
             if "tanh_backward" in c.name else c for c in traced.calls]
    return dataclasses.replace(traced, calls=calls)


def test_a_right_recording_passes_with_its_gradients_and_leaves_the_module_as_it_was():
    model, x, traced = _recorded()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    verify_recording(traced, model, (x,), {}, gradients=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())


def test_a_recording_that_lost_a_dependency_is_refused_when_its_gradients_are_verified():
    model, x, traced = _recorded()
    broken = _losing_the_saved_output(traced)
    verify_recording(broken, model, (x,), {})  # its outputs are the module's: only the gradients tell
    with pytest.raises(UnsupportedModuleError, match="gradient of 'net.0.weight' differs"):
        verify_recording(broken, model, (x,), {}, gradients=True)


def test_a_recording_whose_output_differs_is_refused():
    model, x, traced = _recorded()
    out = traced.graph.outputs[0]["node"]
    calls = [dataclasses.replace(c, func=lambda *a, f=c.func, **k: 2 * f(*a, **k)) if c.name == out else c
             for c in traced.calls]
    wrong = dataclasses.replace(traced, calls=calls)
    with pytest.raises(UnsupportedModuleError, match="output 0 differs"):
        verify_recording(wrong, model, (x,), {})
