"""What a forward may change in a module, and how the SDK reads it, writes it and puts it back: every tensor it
holds by its state_dict-style name (parameters, buffers, plain tensor attributes), a buffer set from a result, a
snapshot taken before a capture runs the forward and restored after it (gradclient/trace.py, replay.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the module holds, by its state_dict-style name: parameters, buffers (persistent or not)
    and plain tensor attributes (`self.codebook = torch.randn(...)` in __init__)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for n, p in sub._parameters.items():
            if p is not None:
                out.setdefault(pre + n, p)
        for n, b in sub._buffers.items():
            if b is not None:
                out.setdefault(pre + n, b)
        for n, v in vars(sub).items():
            if isinstance(v, torch.Tensor) and not n.startswith("_"):
                out.setdefault(pre + n, v)
    return out


def owner_of(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def set_states(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """set_state of each of `values`, the owners found in one walk of the module (get_submodule each walked the
    path again: timm shvit_s1's 222 batch-norm buffers, 4.0 -> 1.4 ms a call)."""
    owners = dict(module.named_modules(remove_duplicate=False)) if len(values) > 8 else None
    for name, value in values.items():
        path, _, attr = name.rpartition(".")
        owner = owners.get(path) if owners is not None else None
        set_state(module, name, value, (owner, attr) if owner is not None else None)


def set_state(module: nn.Module, name: str, value: torch.Tensor, owned: tuple[nn.Module, str] | None = None) -> None:
    """A buffer or tensor attribute of `module` set to `value` (in place when the shape and dtype allow);
    `owned`: the module that holds it and its attribute name, when the caller found them."""
    owner, attr = owned or owner_of(module, name)
    held = getattr(owner, attr, None)
    with torch.no_grad():
        if isinstance(held, torch.Tensor) and held.shape == value.shape and \
                held.layout == value.layout == torch.strided:
            held.copy_(value.to(device=held.device, dtype=held.dtype))
        elif attr in owner._buffers:
            owner._buffers[attr] = value.to(held.device if held is not None else value.device)
        else:
            setattr(owner, attr, value)


@dataclass
class Snapshot:
    """What a forward may change in a module, kept to be put back: its tensor attributes and buffers (the
    objects, and the values of the non-parameters), and torch's RNG."""

    attrs: dict
    saved: dict
    params: set
    rng: torch.Tensor


def snapshot(module: nn.Module) -> Snapshot:
    state = state_of(module)
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return Snapshot(attrs={n: getattr(*owner_of(module, n)) for n in state}, params=params,
                    saved={n: (t, t.detach().clone()) for n, t in state.items() if n not in params},
                    rng=torch.random.get_rng_state())


def restore(module: nn.Module, snap: Snapshot) -> None:
    """The module as `snap` found it: attributes and buffers (objects and values), and the RNG."""
    for n, old in snap.attrs.items():
        if n in snap.params:
            continue
        owner, attr = owner_of(module, n)
        if attr in owner._buffers:
            owner._buffers[attr] = old
        elif attr in vars(owner):
            object.__setattr__(owner, attr, old)
        with torch.no_grad():
            back = snap.saved.get(n, (None, None))[1]
            if back is not None and old.layout == torch.strided and (old.shape != back.shape or
                                                                    not torch.equal(old, back)):
                old.data = back
    torch.random.set_rng_state(snap.rng)
