"""Writing a graph model's written buffers back into the module (gradclient/module_state.py set_states): the
owners found in one walk put every value where set_state, one at a time, puts it."""

from __future__ import annotations

import torch
from torch import nn

from gradclient.module_state import set_state, set_states, state_of


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # two of them alike
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(4)])
        self.shared = self.blocks[1]  # one module under two paths
        self.codebook = torch.zeros(3, 4)  # a plain tensor attribute a forward may write
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))


def _values(net: nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {n: torch.randn(t.shape, generator=g).to(t.dtype) for n, t in state_of(net).items()
           if not isinstance(t, nn.Parameter)}
    out["blocks.2.1.running_var"] = torch.rand(4, generator=g, dtype=torch.float64)  # cast to the buffer's dtype
    out["codebook"] = torch.randn(5, 4, generator=g)  # a new shape: the attribute replaced, not copied into
    return out


def test_set_states_puts_every_value_where_set_state_does():
    values = _values(_Net())
    assert len(values) > 8  # the one-walk path
    one_walk, one_by_one = _Net(), _Net()
    held = one_walk.blocks[0][1].running_mean
    set_states(one_walk, values)
    for name, value in values.items():
        set_state(one_by_one, name, value)
    a, b = state_of(one_walk), state_of(one_by_one)
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert one_walk.blocks[0][1].running_mean is held  # written in place, as a local step leaves it
    assert torch.equal(one_walk.shared[1].running_mean, values["shared.1.running_mean"])  # its last name written
    assert one_walk.codebook.shape == (5, 4)
