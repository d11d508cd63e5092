"""nn.Module -> the API's model spec: allow-listed layers, nn.Sequential nesting, Residual, state_dict weights.

A module is converted only when the spec says exactly what it computes: the torch class itself (not a
subclass, which may change forward), no hooks, and every non-default setting expressible. Anything
else is refused with UnsupportedModuleError naming the layer, before a request is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import UnsupportedModuleError


class Residual(nn.Sequential):
    """x + f(x), with f the contained layers, as the service's `Residual`; names stay nn.Sequential's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


_CONV = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "padding_mode")
_BN = ("num_features", "eps", "momentum", "affine", "track_running_stats")
# type -> (constructor arguments read back from the same-named attributes, attributes that must keep
# their default because the spec cannot say otherwise)
_LEAVES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "Linear": (("in_features", "out_features"), {}),
    "Conv1d": (_CONV, {}),
    "Conv2d": (_CONV, {}),
    "MaxPool1d": (("kernel_size", "stride", "padding", "dilation", "ceil_mode"), {"return_indices": False}),
    "MaxPool2d": (("kernel_size", "stride", "padding", "dilation", "ceil_mode"), {"return_indices": False}),
    "AvgPool1d": (("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"), {}),
    "AvgPool2d": (("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"), {"divisor_override": None}),
    "AdaptiveAvgPool2d": (("output_size",), {}),
    "Flatten": (("start_dim", "end_dim"), {}),
    "Identity": ((), {}),
    "ReLU": ((), {}),
    "LeakyReLU": (("negative_slope",), {}),
    "ELU": (("alpha",), {}),
    "GELU": (("approximate",), {}),
    "SiLU": ((), {}),
    "Softplus": (("beta", "threshold"), {}),
    "Tanh": ((), {}),
    "Sigmoid": ((), {}),
    "Softmax": (("dim",), {}),
    "LogSoftmax": (("dim",), {}),
    "Dropout": (("p",), {}),
    "BatchNorm1d": (_BN, {}),
    "BatchNorm2d": (_BN, {}),
    "LayerNorm": (("normalized_shape", "eps", "elementwise_affine"), {}),
    "Embedding": (("num_embeddings", "embedding_dim", "padding_idx"),
                  {"max_norm": None, "scale_grad_by_freq": False, "sparse": False}),
}
_WITH_BIAS = {"Linear", "Conv1d", "Conv2d"}


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
    if name not in _LEAVES or getattr(nn, name, None) is not kind:
        hint = (f"a subclass of nn.{kind.__mro__[1].__name__} may change forward; " if kind.__mro__[1].__name__ in
                _LEAVES else "")
        raise UnsupportedModuleError(
            f"{where} cannot be expressed as a spec: {hint}use nn.Sequential, gradclient.Residual and the "
            f"allow-listed layers ({', '.join(_LEAVES)}; GET /layers), or send a spec dict",
            detail={"path": path, "type": name})
    args_from, fixed = _LEAVES[name]
    for attr, default in fixed.items():
        if getattr(module, attr, default) != default:
            raise UnsupportedModuleError(f"{where}: {attr}={getattr(module, attr)!r} is not supported by the service; "
                                         f"use {attr}={default!r}", detail={"path": path, "argument": attr})
    spec: dict[str, Any] = {"type": name}
    for attr in args_from:
        value = getattr(module, attr)
        if value is None and attr not in ("padding_idx",):
            raise UnsupportedModuleError(f"{where}: {attr}=None cannot be expressed; give it explicitly",
                                         detail={"path": path, "argument": attr})
        spec[attr] = list(value) if isinstance(value, (tuple, torch.Size)) else value
    if name in _WITH_BIAS:
        spec["bias"] = module.bias is not None
    if name == "LayerNorm" and module.elementwise_affine:
        spec["bias"] = module.bias is not None
    if name == "AdaptiveAvgPool2d" and isinstance(spec["output_size"], list) and None in spec["output_size"]:
        raise UnsupportedModuleError(f"{where}: output_size with None cannot be expressed; give both sizes",
                                     detail={"path": path, "argument": "output_size"})
    renames[path] = local
    return spec
