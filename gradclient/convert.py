"""nn.Module <-> the API's model spec: allow-listed layers, nn.Sequential nesting, Residual, state_dict weights.

Both directions read the service's own layer table (gradsvc.layers): a module's spec lists exactly the
table's arguments, read from the module's attributes, and `to_spec(from_spec(layers))["layers"]` gives
the layers back (in canonical form: every argument, as torch keeps it). A module is converted only when
the spec says exactly what it computes: the torch class itself (not a subclass, which may change
forward), no hooks, and every setting expressible. Anything else is refused with UnsupportedModuleError
naming the layer, before a request is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradsvc.layers import CONTAINERS, LAYERS, ArgumentError, canonical, read_args, to_torch
from gradsvc.modules import GRU, LSTM, RNN, Residual, layer_class

from .errors import UnsupportedModuleError

__all__ = ["Converted", "convert", "to_spec", "from_spec", "Residual", "RNN", "LSTM", "GRU",
           "UnsupportedModuleError"]


_RECURRENT = {nn.RNN: "RNN", nn.LSTM: "LSTM", nn.GRU: "GRU"}


@dataclass
class Converted:
    """The spec's layers and weights, and each service parameter name's local state_dict name."""

    layers: list[dict[str, Any]]
    dtype: str
    weights: dict[str, torch.Tensor]
    local_names: dict[str, str]  # service name ("0.weight") -> local name ("fc1.weight")
    frozen: list[str]  # service names of parameters with requires_grad=False


def to_spec(model: nn.Module) -> dict[str, Any]:
    """The `model` object of a request (layers, dtype, weights as tensors) for `model`."""
    c = convert(model)
    return {"layers": c.layers, "dtype": c.dtype, "weights": c.weights}


def convert(model: nn.Module) -> Converted:
    if not isinstance(model, nn.Module):
        raise UnsupportedModuleError(f"expected an nn.Module or a spec dict, got {type(model).__name__}")
    renames: dict[str, str] = {}  # service module path -> local module path
    if type(model) is nn.Sequential:
        layers = _children(model, "", "", renames)
    else:  # a single layer or Residual: the spec is a Sequential holding it at index 0
        layers = [_one(model, "0", "", renames)]
    local_names, weights, frozen, dtypes = {}, {}, [], set()
    params = dict(model.named_parameters())
    state = model.state_dict()
    for path_here, local in renames.items():
        module = model.get_submodule(local) if local else model
        for key in module.state_dict(keep_vars=True).keys():
            if "." in key:  # owned by a child, listed under the child's own path
                continue
            local_key = f"{local}.{key}" if local else key
            name = f"{path_here}.{key}"
            local_names[name] = local_key
            weights[name] = state[local_key]
            if local_key in params:
                dtypes.add(params[local_key].dtype)
                if not params[local_key].requires_grad:
                    frozen.append(name)
    float_dtypes = {d for d in dtypes if d.is_floating_point}
    if len(float_dtypes) > 1:
        raise UnsupportedModuleError(f"the model mixes parameter dtypes {sorted(map(str, float_dtypes))}; the spec has "
                                     "one dtype: call model.to(torch.float64) (or the dtype you want) first")
    dtype = str(float_dtypes.pop() if float_dtypes else torch.get_default_dtype()).removeprefix("torch.")
    return Converted(layers=layers, dtype=dtype, weights=weights, local_names=local_names, frozen=frozen)


def _children(seq: nn.Sequential, path: str, local: str, renames: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for i, (name, child) in enumerate(seq.named_children()):
        here = f"{path}.{i}" if path else str(i)
        out.append(_one(child, here, f"{local}.{name}" if local else name, renames))
    if not out:
        raise UnsupportedModuleError(f"{_where(path, seq)} is an empty container; the spec needs at least one layer")
    return out


def _where(path: str, module: nn.Module) -> str:
    return f"layer {path or '0'} ({type(module).__name__})"


def _one(module: nn.Module, path: str, local: str, renames: dict[str, str]) -> dict[str, Any]:
    where = _where(path, module)
    if module._forward_hooks or module._forward_pre_hooks or getattr(module, "_backward_hooks", None):
        raise UnsupportedModuleError(f"{where} has hooks, which the service would not run; remove them")
    kind = type(module)
    if kind is nn.Sequential or kind is Residual:
        return {"type": kind.__name__, "layers": _children(module, path, local, renames)}
    name = kind.__name__
    if kind in _RECURRENT:
        raise UnsupportedModuleError(
            f"{where}: the service's {name} outputs the output sequence alone (torch's returns a tuple, which a "
            f"stack cannot pass on); use gradclient.{name}, the same layer with that output",
            detail={"path": path, "type": name})
    if name not in LAYERS or layer_class(name) is not kind:
        parent = kind.__mro__[1].__name__
        hint = f"a subclass of nn.{parent} may change forward; " if parent in LAYERS else ""
        raise UnsupportedModuleError(
            f"{where} cannot be expressed as a spec: {hint}use nn.Sequential, gradclient.Residual and the "
            f"allow-listed layers ({', '.join(LAYERS)}; GET /layers), or send a spec dict",
            detail={"path": path, "type": name})
    try:
        args = read_args(name, module)
        checked = canonical(name, args)
    except ArgumentError as exc:
        shown = f"{exc.argument}={args[exc.argument]!r}" if exc.argument in args else exc.argument
        raise UnsupportedModuleError(f"{where}: {shown} is not supported by the service; expected {exc.expected}",
                                     detail={"path": path, "argument": exc.argument}) from None
    except ValueError as exc:  # an attribute the table cannot read back (a custom activation function)
        raise UnsupportedModuleError(f"{where}: {exc}", detail={"path": path}) from None
    renames[path] = local
    return {"type": name, **checked}


def from_spec(layers: list[dict[str, Any]]) -> nn.Sequential:
    """The nn.Sequential a spec's `layers` describe, as the service builds it (parameters created in spec
    order, so `torch.manual_seed(s)` first gives the service's seeded initial weights)."""
    return _build(nn.Sequential, layers, "")


def _build(cls: type[nn.Sequential], layers: Any, path: str) -> nn.Sequential:
    if not isinstance(layers, list) or not layers:
        raise UnsupportedModuleError(f"layer {path or '0'}: 'layers' must be a non-empty list of layer objects")
    modules = []
    for i, spec in enumerate(layers):
        here = f"{path}.{i}" if path else str(i)
        kind = spec.get("type") if isinstance(spec, dict) else None
        args = {k: v for k, v in spec.items() if k != "type"} if isinstance(spec, dict) else {}
        if kind in CONTAINERS:
            modules.append(_build(Residual if kind == "Residual" else nn.Sequential, args.get("layers"), here))
            continue
        if kind not in LAYERS:
            raise UnsupportedModuleError(f"layer {here}: unknown type {kind!r}; allowed: {', '.join(LAYERS)}",
                                         detail={"path": here, "type": kind})
        try:
            kwargs = canonical(kind, args)
        except ArgumentError as exc:
            raise UnsupportedModuleError(f"layer {here} ({kind}): {exc}", detail={"path": here,
                                                                                  "argument": exc.argument}) from None
        modules.append(layer_class(kind)(**{k: to_torch(v) for k, v in kwargs.items()}))
    return cls(*modules)
