"""Frozen weights shared by the training sessions on one worker (docs/sessions.md, "Adapters on one base"): a
frozen parameter a session's model names by reference (its wire tensor's `refs`, the sha256 of each piece of its
bytes) is held once per worker and device, read-only, whichever sessions name the same pieces; what a session owns
is its trainable parameters, their optimizer state and its buffers. This is how many LoRA sessions fine-tune on
one base: eight over GPT-2 small hold one copy of the base.

A weight is known by (device, dtype, shape, refs): refs are content hashes, and a worker fills a tensor from its
owner's own pieces only (BlobStore.resolved, after the API checked that the key holds every piece it names), so
two keys share a weight only when each sent the bytes itself, and no key learns what another holds. The store
holds its tensors weakly: a base goes when the last session naming it goes. A frozen weight is never written:
the optimizer holds only trainable parameters, a graph refuses in-place writes to parameters
(graph/compiler.py), and a checkpoint neither saves nor loads it (session_state.py: the session's own state)."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from gradsvc.wire import Tensor, by_reference

from . import tensors
from .errors import SpecError


class FrozenStore:
    """(device, dtype, shape, refs) -> the one parameter every session on this worker naming them holds."""

    def __init__(self) -> None:
        self._held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    @property
    def held_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in list(self._held.values()))

    def __len__(self) -> int:
        return len(self._held)

    def held_for(self, model: nn.Module, weights: dict[str, Tensor],
                 device: str | torch.device) -> dict[str, nn.Parameter]:
        """The store's parameters for those of `weights` (frozen, by reference) it holds on `device`, known by the
        dtype and shape of `model`'s parameter of each name (a model on meta: the session's model before it is
        built, which then holds these, no copy of them made)."""
        params, where = dict(model.named_parameters(remove_duplicate=False)), _device_name(device)
        out = {}
        for name, wire in weights.items():
            p = params.get(name)
            held = self._held.get((where, str(p.dtype), tuple(p.shape), tuple(wire.refs))) \
                if p is not None and wire.refs else None
            if held is not None:
                out[name] = held
        return out

    def holding(self, weights: dict[str, Tensor] | None, names, device: str | torch.device) -> dict[str, nn.Parameter]:
        """Those of `weights` among `names` (a session's frozen base, by reference) whose bytes (refs) and shape the
        store holds on `device`, in whatever dtype: the worker fetches none of their pieces (held_for then finds
        them, or the session is built again with them fetched). The caller keeps the answer while the session is
        built, so that they stay held."""
        where = _device_name(device)
        index = {(k[2], k[3]): v for k, v in list(self._held.items()) if k[0] == where}
        out = {}
        for name, wire in by_reference(weights, names).items():
            held = index.get((tuple(wire.shape), tuple(wire.refs)))
            if held is not None:
                out[name] = held
        return out

    def share(self, model: nn.Module, weights: dict[str, Tensor], max_elements: int, loaded: bool) -> set[str]:
        """Puts the store's parameter in place of each of `weights` (frozen parameters by reference) in `model`,
        its own copy dropped. A weight the store lacks becomes the store's: the model's parameter when `loaded`
        (built with its weights), else one made from the weight's bytes (a session restored from its checkpoint,
        which holds no frozen weight). Answers the names shared."""
        params = dict(model.named_parameters(remove_duplicate=False))
        shared: set[str] = set()
        for name, wire in weights.items():
            p = params.get(name)
            if p is None or not wire.refs:
                continue
            key = (str(p.device), str(p.dtype), tuple(p.shape), tuple(wire.refs))
            held = self._held.get(key)
            if held is None:
                if not loaded:
                    if wire.data is None and wire.b64 is None:
                        raise SpecError("tensor_not_found", f"model.weights[{name!r}]: the frozen weight's pieces "
                                        "are gone; upload them again (PUT /tensors/{sha256})", where=name)
                    value = tensors.decode(wire, where=f"model.weights[{name!r}]", max_elements=max_elements)
                    with torch.no_grad():
                        p.copy_(value)
                held = nn.Parameter(p.detach(), requires_grad=False)
                self._held[key] = held
            _replace(model, p, held)
            shared.add(name)
        return shared


def _device_name(device: str | torch.device) -> str:
    """The device as a tensor on it names it (the store's key: "cuda:0" for "cuda")."""
    return str(torch.empty(0, device=device).device)


def _replace(model: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Every place `model` holds `old` (tied weights included) holds `new` instead."""
    for module in model.modules():
        for attr, value in list(module._parameters.items()):
            if value is old:
                module._parameters[attr] = new
