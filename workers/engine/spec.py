"""Model spec -> nn.Module: the layer allow-list, argument validation, shape checks on the meta device."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .errors import SpecError


class Residual(nn.Sequential):
    """x + f(x), with f the contained layers; names stay nn.Sequential's ("2.0.weight")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


# Argument kinds: each a (description, checker) pair; a checker returns the value to pass or raises.
def _int(minimum: int = 0) -> tuple[str, Callable[[Any], Any]]:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"an integer >= {minimum}")
        return v

    return f"int>={minimum}", check


def _ints(minimum: int = 0) -> tuple[str, Callable[[Any], Any]]:
    def check(v):
        if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) and x >= minimum for x in v):
            return tuple(v)
        if isinstance(v, int) and not isinstance(v, bool) and v >= minimum:
            return v
        raise ValueError(f"an integer >= {minimum} or a list of them")

    return f"int>={minimum}|list[int]", check


def _float(lo: float = -math.inf, hi: float = math.inf) -> tuple[str, Callable[[Any], Any]]:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi) or not math.isfinite(v):
            raise ValueError(f"a finite number in [{lo}, {hi}]")
        return float(v)

    return f"float in [{lo}, {hi}]", check


def _bool() -> tuple[str, Callable[[Any], Any]]:
    def check(v):
        if not isinstance(v, bool):
            raise ValueError("true or false")
        return v

    return "bool", check


def _choice(*choices: Any) -> tuple[str, Callable[[Any], Any]]:
    def check(v):
        if v not in choices or isinstance(v, bool) != isinstance(choices[0], bool):
            raise ValueError(f"one of {list(choices)}")
        return v

    return "|".join(map(str, choices)), check


def _padding() -> tuple[str, Callable[[Any], Any]]:
    _, ints = _ints(0)

    def check(v):
        return v if v in ("same", "valid") else ints(v)

    return "int>=0|list[int]|same|valid", check


def _optional_int() -> tuple[str, Callable[[Any], Any]]:
    _, int_ = _int(-(2**31))

    def check(v):
        return None if v is None else int_(v)

    return "int|null", check


@dataclass(frozen=True)
class LayerType:
    cls: type[nn.Module]
    required: dict[str, tuple[str, Callable]] = field(default_factory=dict)
    optional: dict[str, tuple[str, Callable]] = field(default_factory=dict)


_CONV = {"in_channels": _int(1), "out_channels": _int(1), "kernel_size": _ints(1)}
_CONV_OPT = {"stride": _ints(1), "padding": _padding(), "dilation": _ints(1), "groups": _int(1), "bias": _bool(),
             "padding_mode": _choice("zeros", "reflect", "replicate", "circular")}
_POOL_OPT = {"stride": _ints(1), "padding": _ints(0), "ceil_mode": _bool()}
_BN = {"num_features": _int(1)}
_BN_OPT = {"eps": _float(0, 1), "momentum": _float(0, 1), "affine": _bool(), "track_running_stats": _bool()}

LAYERS: dict[str, LayerType] = {
    "Linear": LayerType(nn.Linear, {"in_features": _int(1), "out_features": _int(1)}, {"bias": _bool()}),
    "Conv1d": LayerType(nn.Conv1d, _CONV, _CONV_OPT),
    "Conv2d": LayerType(nn.Conv2d, _CONV, _CONV_OPT),
    "MaxPool1d": LayerType(nn.MaxPool1d, {"kernel_size": _ints(1)}, {**_POOL_OPT, "dilation": _ints(1)}),
    "MaxPool2d": LayerType(nn.MaxPool2d, {"kernel_size": _ints(1)}, {**_POOL_OPT, "dilation": _ints(1)}),
    "AvgPool1d": LayerType(nn.AvgPool1d, {"kernel_size": _ints(1)}, {**_POOL_OPT, "count_include_pad": _bool()}),
    "AvgPool2d": LayerType(nn.AvgPool2d, {"kernel_size": _ints(1)}, {**_POOL_OPT, "count_include_pad": _bool()}),
    "AdaptiveAvgPool2d": LayerType(nn.AdaptiveAvgPool2d, {"output_size": _ints(1)}),
    "Flatten": LayerType(nn.Flatten, {}, {"start_dim": _int(-8), "end_dim": _int(-8)}),
    "Identity": LayerType(nn.Identity),
    "ReLU": LayerType(nn.ReLU),
    "LeakyReLU": LayerType(nn.LeakyReLU, {}, {"negative_slope": _float(-1e3, 1e3)}),
    "ELU": LayerType(nn.ELU, {}, {"alpha": _float(0, 1e3)}),
    "GELU": LayerType(nn.GELU, {}, {"approximate": _choice("none", "tanh")}),
    "SiLU": LayerType(nn.SiLU),
    "Softplus": LayerType(nn.Softplus, {}, {"beta": _float(1e-6, 1e3), "threshold": _float(0, 1e3)}),
    "Tanh": LayerType(nn.Tanh),
    "Sigmoid": LayerType(nn.Sigmoid),
    "Softmax": LayerType(nn.Softmax, {}, {"dim": _int(-8)}),
    "LogSoftmax": LayerType(nn.LogSoftmax, {}, {"dim": _int(-8)}),
    "Dropout": LayerType(nn.Dropout, {}, {"p": _float(0, 1)}),
    "BatchNorm1d": LayerType(nn.BatchNorm1d, _BN, _BN_OPT),
    "BatchNorm2d": LayerType(nn.BatchNorm2d, _BN, _BN_OPT),
    "LayerNorm": LayerType(nn.LayerNorm, {"normalized_shape": _ints(1)}, {"eps": _float(0, 1), "elementwise_affine": _bool(), "bias": _bool()}),
    "Embedding": LayerType(nn.Embedding, {"num_embeddings": _int(1), "embedding_dim": _int(1)}, {"padding_idx": _optional_int()}),
}
CONTAINERS: dict[str, type[nn.Sequential]] = {"Sequential": nn.Sequential, "Residual": Residual}


def layer_catalogue() -> list[dict[str, Any]]:
    """What GET /layers lists: every allowed type with its arguments."""
    out = []
    for name, lt in LAYERS.items():
        args = {k: d for k, (d, _) in {**lt.required, **lt.optional}.items()}
        out.append({"type": name, "arguments": args, "required": list(lt.required), "container": False})
    for name in CONTAINERS:
        out.append({"type": name, "arguments": {"layers": "list[layer]"}, "required": ["layers"], "container": True})
    return out


@dataclass(frozen=True)
class Limits:
    max_parameters: int = 100_000_000
    max_layers: int = 512
    max_depth: int = 8
    max_elements: int = 64_000_000


def build(layers: list[dict[str, Any]], *, limits: Limits, device: str | torch.device = "cpu") -> nn.Sequential:
    """The nn.Sequential a spec describes, on `device` (meta for validation), float32 default init.

    Parameters are created in spec order, so `torch.manual_seed(seed)` before this call gives the same
    initial weights as a local nn.Sequential built after the same seed.
    """
    count = [0]
    with torch.device(device):
        model = _build_seq(nn.Sequential, layers, path="", depth=1, limits=limits, count=count)
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


def _build_seq(cls, layers, *, path: str, depth: int, limits: Limits, count: list[int]) -> nn.Sequential:
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
        modules.append(_build_one(spec, path=here, depth=depth, limits=limits, count=count))
    return cls(*modules)


def _build_one(spec: Any, *, path: str, depth: int, limits: Limits, count: list[int]) -> nn.Module:
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
        return _build_seq(CONTAINERS[kind], args.get("layers"), path=path, depth=depth + 1, limits=limits, count=count)
    lt = LAYERS.get(kind)
    if lt is None:
        raise SpecError(
            "unknown_layer",
            f"layer {path}: unknown type {kind!r}; allowed: {', '.join([*LAYERS, *CONTAINERS])} (GET /layers)",
            path=path,
            type=kind,
        )
    allowed = {**lt.required, **lt.optional}
    for name in args:
        if name not in allowed:
            raise SpecError("unknown_layer", f"layer {path} ({kind}): unknown argument {name!r}; accepted: "
                            f"{', '.join(allowed) or 'none'}", path=path, argument=name)
    for name in lt.required:
        if name not in args:
            raise SpecError("unknown_layer", f"layer {path} ({kind}): missing required argument {name!r}",
                            path=path, argument=name)
    kwargs = {}
    for name, value in args.items():
        desc, check = allowed[name]
        try:
            kwargs[name] = check(value)
        except ValueError as exc:
            raise SpecError("unknown_layer", f"layer {path} ({kind}): {name}={value!r} is invalid; expected {exc}",
                            path=path, argument=name) from None
    try:
        return lt.cls(**kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        # torch's own text, first line only: C++ errors append a stack of frames
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        if "Overflow" in reason or "unpack" in reason:
            reason = "a size is too large to allocate; use sizes below 2**31"
        raise SpecError("unknown_layer", f"layer {path} ({kind}): {reason}; check its arguments against GET /layers",
                        path=path) from None


def leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(state_dict prefix, module) for every module without children, in forward order."""
    return [(name, m) for name, m in model.named_modules() if name and not list(m.children())]


def warm_up_shape_check() -> None:
    """A process's first forward on the meta device loads torch's meta kernels: seconds, once. Processes that
    validate requests call this at start-up so that no request pays it."""
    check_shapes(build([{"type": "Linear", "in_features": 2, "out_features": 2}], limits=Limits(), device="meta"),
                 torch.empty(1, 2, device="meta"))


def check_shapes(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Runs `x` (on meta) through the model, naming the first layer that cannot take its input."""
    return _run_checked(model, x, path="", source="the inputs")


def _run_checked(seq: nn.Sequential, x: torch.Tensor, *, path: str, source: str) -> torch.Tensor:
    for i, module in enumerate(seq):
        here = f"{path}.{i}" if path else str(i)
        if isinstance(module, nn.Sequential):
            y = _run_checked(module, x, path=here, source=source)
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
                x = module(x)
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                raise SpecError("shape_mismatch", f"layer {here} ({type(module).__name__}) cannot take input of shape "
                                f"{list(x.shape)} from {source}: {exc}", path=here, input_shape=list(x.shape)) from None
        source = f"layer {here} ({type(module).__name__})"
    return x


def _precheck(m: nn.Module, x: torch.Tensor, here: str, source: str) -> None:
    name = type(m).__name__
    shape = list(x.shape)

    def fail(msg: str, **detail: Any) -> None:
        raise SpecError("shape_mismatch", f"layer {here} ({name}) {msg}", path=here, input_shape=shape, **detail)

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
    elif isinstance(m, (nn.Conv1d, nn.Conv2d)):
        d = 1 if isinstance(m, nn.Conv1d) else 2
        if x.dim() not in (d + 1, d + 2):
            fail(f"expects a {d + 2}-d input (batch, channels, {'length' if d == 1 else 'height, width'}), "
                 f"got shape {shape} from {source}")
        if shape[-(d + 1)] != m.in_channels:
            got = shape[-(d + 1)]
            fail(f"expects {m.in_channels} input channels, got {got} from {source}; set in_channels={got}",
                 expected=m.in_channels, got=got)
    elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
        dims = (2, 3) if isinstance(m, nn.BatchNorm1d) else (4,)
        if x.dim() not in dims:
            fail(f"expects a {' or '.join(map(str, dims))}-d input, got shape {shape} from {source}")
        if shape[1] != m.num_features:
            fail(f"expects {m.num_features} features in dim 1, got {shape[1]} from {source}; "
                 f"set num_features={shape[1]}", expected=m.num_features, got=shape[1])
    elif isinstance(m, nn.LayerNorm):
        k = len(m.normalized_shape)
        if shape[-k:] != list(m.normalized_shape):
            fail(f"normalizes over the last dims {list(m.normalized_shape)}, got shape {shape} from {source}; "
                 f"set normalized_shape={shape[-k:]}", expected=list(m.normalized_shape))
