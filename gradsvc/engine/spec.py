"""Model spec -> nn.Module: build from the layer table (gradsvc.layers), shape checks on the meta device."""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from gradsvc.layers import CONTAINERS, LAYERS, ArgumentError, canonical, catalogue, to_torch
from gradsvc.modules import Residual, layer_class

from .errors import SpecError

__all__ = ["LAYERS", "CONTAINERS", "Residual", "Limits", "build", "validate_shapes", "layer_catalogue", "leaves",
           "prepare_for_meta", "sequence_first"]

_CONTAINER_CLASSES = MappingProxyType({"Sequential": nn.Sequential, "Residual": Residual})


def layer_catalogue() -> list[dict[str, Any]]:
    """What GET /layers lists: every allowed type with its arguments, defaults and ranges."""
    return catalogue()


@dataclass(frozen=True)
class Limits:
    max_parameters: int = 200_000_000  # GRADSVC_MAX_PARAMETERS (gradsvc/runtime/settings.py says why)
    max_layers: int = 512
    max_depth: int = 8
    max_elements: int = 64_000_000
    # Graph models: nodes in one graph (GRADSVC_MAX_GRAPH_NODES; its cost: gradsvc/runtime/settings.py), and the
    # bytes of all its intermediates together (meta-checked).
    max_graph_nodes: int = 5_000
    max_graph_intermediate_bytes: int = 16 << 30


def build(layers: list[dict[str, Any]], *, limits: Limits, device: str | torch.device = "cpu") -> nn.Sequential:
    """The nn.Sequential a spec describes, on `device` (meta for validation), float32 default init.

    Parameters are created in spec order, so `torch.manual_seed(seed)` before this call gives the same
    initial weights as a local nn.Sequential built after the same seed.
    """
    count = [0]
    with torch.device(device):
        model = _build_seq(nn.Sequential, layers, path="", depth=1, limits=limits, count=count, in_residual=False)
    n = sum(p.numel() for p in model.parameters())
    if n > limits.max_parameters:
        raise SpecError(
            "too_large",
            f"the model has {n} parameters, above the limit of {limits.max_parameters}; use a smaller model",
            parameter_count=n,
            limit=limits.max_parameters,
        )
    return model


def _where(path: str) -> str:
    return f"layer {path}" if path else "the model"


def _build_seq(cls, layers, *, path: str, depth: int, limits: Limits, count: list[int],
               in_residual: bool) -> nn.Sequential:
    if depth > limits.max_depth:
        raise SpecError("too_large", f"{_where(path)}: containers nest deeper than {limits.max_depth} levels",
                        path=path, limit=limits.max_depth)
    if not isinstance(layers, list) or not layers:
        # A structural fault, as the schema states it for model.layers: not an unknown layer.
        raise SpecError("invalid_body", f"{_where(path)}: 'layers' must be a non-empty list of layer objects, got "
                        f"{'an empty list' if layers == [] else type(layers).__name__}; give at least one layer",
                        path=path)
    modules = []
    for i, spec in enumerate(layers):
        here = f"{path}.{i}" if path else str(i)
        count[0] += 1
        if count[0] > limits.max_layers:
            raise SpecError("too_large", f"more than {limits.max_layers} layers; use fewer layers",
                            limit=limits.max_layers)
        modules.append(_build_one(spec, path=here, depth=depth, limits=limits, count=count, in_residual=in_residual))
    return cls(*modules)


def _build_one(spec: Any, *, path: str, depth: int, limits: Limits, count: list[int], in_residual: bool) -> nn.Module:
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        got = f"keys {sorted(spec)}" if isinstance(spec, dict) else type(spec).__name__
        raise SpecError("invalid_body", f"layer {path}: expected an object with a string 'type' (GET /layers lists "
                        f"the types), got {got}", path=path)
    kind = spec["type"]
    args = {k: v for k, v in spec.items() if k != "type"}
    if kind in CONTAINERS:
        extra = set(args) - {"layers"}
        if extra:
            raise SpecError("unknown_layer", f"layer {path} ({kind}): unexpected keys {sorted(extra)}; "
                            "a container takes only 'layers'", path=path)
        return _build_seq(_CONTAINER_CLASSES[kind], args.get("layers"), path=path, depth=depth + 1, limits=limits,
                          count=count, in_residual=in_residual or kind == "Residual")
    layer = LAYERS.get(kind)
    if layer is None:
        raise SpecError(
            "unknown_layer",
            f"layer {path}: unknown type {kind!r}; allowed: {', '.join([*LAYERS, *CONTAINERS])} (GET /layers)",
            path=path,
            type=kind,
        )
    for name in args:
        if name not in layer.args:
            raise SpecError("unknown_layer", f"layer {path} ({kind}): unknown argument {name!r}; accepted: "
                            f"{', '.join(layer.args) or 'none'}", path=path, argument=name)
    for name, arg in layer.args.items():
        if arg.required and name not in args:
            raise SpecError("unknown_layer", f"layer {path} ({kind}): missing required argument {name!r}",
                            path=path, argument=name)
    try:
        kwargs = canonical(kind, args)
    except ArgumentError as exc:
        shown = f"{exc.argument}={args[exc.argument]!r}" if exc.argument in args else exc.argument
        raise SpecError("unknown_layer", f"layer {path} ({kind}): {shown} is invalid; expected {exc.expected}",
                        path=path, argument=exc.argument) from None
    if kwargs.get("inplace"):
        if in_residual:
            raise SpecError("unknown_layer", f"layer {path} ({kind}): inplace=true inside a Residual would overwrite "
                            "the input the Residual adds back; set inplace=false", path=path, argument="inplace")
        # Out of place gives the same values wherever torch's in-place run succeeds, and keeps the request's
        # inputs intact for the numerical check's repeated forwards.
        kwargs["inplace"] = False
    try:
        return construct(layer_class(kind), {name: to_torch(value) for name, value in kwargs.items()})
    except (ValueError, TypeError, RuntimeError, AssertionError, ArithmeticError) as exc:
        # torch's own text, first line only: C++ errors append a stack of frames
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        if "Overflow" in reason or "unpack" in reason:
            reason = "a size is too large to allocate; use sizes below 2**31"
        raise SpecError("unknown_layer", f"layer {path} ({kind}): torch refuses these arguments: {reason}; check "
                        "them against GET /layers",
                        path=path) from None


def construct(cls: type[nn.Module], kwargs: dict[str, Any]) -> nn.Module:
    """cls(**kwargs) on any admitted torch: a norm layer's `bias` argument is newer than some (BatchNorm's,
    InstanceNorm's), where the layer is built with its affine parameters and bias=False removes the bias, as
    the newer constructor does (its forward then passes None, its state_dict has no bias)."""
    if "bias" not in kwargs or _takes(cls, "bias"):
        return cls(**kwargs)
    kwargs = dict(kwargs)
    bias = kwargs.pop("bias")
    module = cls(**kwargs)
    if not bias and getattr(module, "bias", None) is not None:
        module.register_parameter("bias", None)
    return module


@functools.cache  # a constructor's signature, read once per class
def _takes(cls: type, argument: str) -> bool:
    """Whether cls's constructor takes `argument`: by name, or through **kwargs (RNN's, whose `bias` is a flag)."""
    parameters = inspect.signature(cls.__init__).parameters
    return argument in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(state_dict prefix, module) for every module without children, in forward order."""
    return [(name, m) for name, m in model.named_modules() if name and not list(m.children())]


def warm_up_shape_check() -> None:
    """A process's first forward on the meta device loads torch's meta kernels: seconds, once. Processes that
    validate requests call this at start-up so that no request pays it."""
    validate_shapes(build([{"type": "Linear", "in_features": 2, "out_features": 2}], limits=Limits(), device="meta"),
                 torch.empty(1, 2, device="meta"))


def validate_shapes(model: nn.Sequential, x: torch.Tensor, *, max_elements: int = Limits.max_elements) -> torch.Tensor:
    """Runs `x` (on meta) through the model, naming the first layer that cannot take its input, or whose
    output would hold more than `max_elements` (an Upsample, a padding or a transposed convolution can
    ask for any size)."""
    return _run_checked(model, x, path="", source="the inputs", max_elements=max_elements)


def _run_checked(seq: nn.Sequential, x: torch.Tensor, *, path: str, source: str, max_elements: int) -> torch.Tensor:
    for i, module in enumerate(seq):
        here = f"{path}.{i}" if path else str(i)
        name = type(module).__name__
        if isinstance(module, nn.Sequential):
            y = _run_checked(module, x, path=here, source=source, max_elements=max_elements)
            if isinstance(module, Residual):
                if y.shape != x.shape:
                    raise SpecError("shape_mismatch", f"layer {here} (Residual) must keep its input's shape "
                                    f"{list(x.shape)} to add it, but its layers give {list(y.shape)}",
                                    path=here, input_shape=list(x.shape), output_shape=list(y.shape))
                y = x + y
            x = y
        else:
            _precheck(module, x, here, source)
            try:
                x = _on_meta(module)(x)
            except (RuntimeError, ValueError, IndexError, TypeError, AssertionError, ArithmeticError) as exc:
                raise SpecError("shape_mismatch", f"layer {here} ({name}) cannot take input of shape "
                                f"{list(x.shape)} from {source}: {exc}", path=here, input_shape=list(x.shape)) from None
        if x.numel() > max_elements:
            raise SpecError("too_large", f"layer {here} ({name}) outputs shape {list(x.shape)}, {x.numel()} elements, "
                            f"above the limit of {max_elements} per tensor; use smaller sizes or a smaller batch",
                            path=here, output_shape=list(x.shape), limit=max_elements)
        source = f"layer {here} ({name})"
    return x


def sequence_first(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first layer whose batch dimension is not dim 0 (a recurrent or transformer layer with
    batch_first=false takes (sequence, batch, features)), which splitting the batch along dim 0 would cut
    across sequences instead; None when every layer is batch first."""
    for name, m in model.named_modules():
        if isinstance(m, nn.RNNBase) and not m.batch_first:
            return name, m
        if isinstance(m, nn.TransformerEncoderLayer) and not m.self_attn.batch_first:
            return name, m
    return None


def prepare_for_meta(model: nn.Module) -> None:
    """Readies a throwaway meta model to run forward (POST /estimate): see _on_meta."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.momentum is None:
            m.momentum = 0.0


def _on_meta(m: nn.Module) -> nn.Module:
    """The module to run for shapes. Batch norm with momentum=None (a cumulative average) reads its batch
    count with .item(), which a meta tensor cannot give; the same layer with a fixed momentum has the
    same output shape."""
    if isinstance(m, nn.modules.batchnorm._NormBase) and m.momentum is None and m.training:
        m = copy.copy(m)
        m.momentum = 0.0
    return m


def _precheck(m: nn.Module, x: torch.Tensor, here: str, source: str) -> None:
    name = type(m).__name__
    shape = list(x.shape)

    def fail(msg: str, **detail: Any) -> None:
        raise SpecError("shape_mismatch", f"layer {here} ({name}) {msg}", path=here, input_shape=shape, **detail)

    def expect_dim(dims: tuple[int, ...], what: str) -> None:
        if x.dim() not in dims:
            fail(f"expects a {' or '.join(map(str, dims))}-d input ({what}), got shape {shape} from {source}")

    def expect_size(dim: int, want: int, arg: str, what: str) -> None:
        if shape[dim] != want:
            fail(f"expects {want} {what}, got {shape[dim]} from {source}; set {arg}={shape[dim]}",
                 expected=want, got=shape[dim])

    if isinstance(m, nn.Embedding):
        if x.dtype.is_floating_point:
            fail(f"takes integer indices, got {x.dtype} from {source}; send int64 inputs")
        return
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        fail(f"takes floating-point input, got {x.dtype} from {source}")
    if isinstance(m, nn.Linear):
        if x.dim() == 0 or shape[-1] != m.in_features:
            got = shape[-1] if shape else "a scalar"
            fail(f"expects {m.in_features} input features, got {got} from {source}; set in_features={got}",
                 expected=m.in_features, got=got)
    elif isinstance(m, nn.modules.conv._ConvNd):
        d = len(m.kernel_size)
        expect_dim((d + 1, d + 2), f"batch, channels, {('length', 'height, width', 'depth, height, width')[d - 1]}")
        expect_size(-(d + 1), m.in_channels, "in_channels", "input channels")
    elif isinstance(m, nn.modules.batchnorm._BatchNorm):
        dims = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}.get(type(m))
        if dims:
            expect_dim(dims, "batch, features, ...")
        expect_size(1, m.num_features, "num_features", "features in dim 1")
    elif isinstance(m, nn.modules.instancenorm._InstanceNorm):
        d = {nn.InstanceNorm1d: 1, nn.InstanceNorm2d: 2, nn.InstanceNorm3d: 3}[type(m)]
        expect_dim((d + 1, d + 2), "(batch,) channels, spatial dims")
        if m.affine or m.track_running_stats:
            expect_size(-(d + 1), m.num_features, "num_features", "channels")
    elif isinstance(m, nn.GroupNorm):
        if x.dim() < 2:
            fail(f"expects a (batch, channels, ...) input, got shape {shape} from {source}")
        expect_size(1, m.num_channels, "num_channels", "channels in dim 1")
    elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
        k = len(m.normalized_shape)
        if shape[-k:] != list(m.normalized_shape):
            fail(f"normalizes over the last dims {list(m.normalized_shape)}, got shape {shape} from {source}; "
                 f"set normalized_shape={shape[-k:]}", expected=list(m.normalized_shape))
    elif isinstance(m, nn.RNNBase):
        expect_dim((2, 3), "(batch,) sequence, features; batch first when batch_first=true")
        expect_size(-1, m.input_size, "input_size", "input features")
    elif isinstance(m, nn.TransformerEncoderLayer):
        expect_dim((2, 3), "(batch,) sequence, d_model; batch first when batch_first=true")
        expect_size(-1, m.self_attn.embed_dim, "d_model", "features (d_model) in the last dim")
