"""A training session's optimizer and its state as bytes: torch.optim's SGD, Adam or AdamW built from the wire's
OptimizerSpec (an argument left out takes torch's default), and the session's state (weights and buffers, the
optimizer's per-parameter tensors, gradients still accumulating, the step and the seed) as one safetensors file:
tensors by name, the rest as the file's metadata. Never pickle: a checkpoint is read by safetensors and msgspec
alone, so a checkpoint's bytes cannot run code.

Tensor names: `model/<state_dict name>`, `optim/<parameter>/<state key>` (momentum_buffer, exp_avg, exp_avg_sq,
max_exp_avg_sq, step), `grad/<parameter>`. Metadata: `format`, `step`, `accumulated`, `seed`, `param_groups`
(JSON: the optimizer's hyperparameters, lr included, as the last step left them).
"""

from __future__ import annotations

import math
import struct
from types import MappingProxyType

import msgspec
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from gradsvc.wire import OptimizerSpec

from .errors import SpecError

FORMAT = "gradsvc-session/1"
OPTIMIZERS = MappingProxyType({"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW})
ARGUMENTS = MappingProxyType({
    "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize"),
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
})
# The hyperparameters a checkpoint keeps (param_groups' entries other than `params`): what load_state_dict needs.
_GROUP_SKIP = ("params",)


def optimizer_arguments(spec: OptimizerSpec) -> dict:
    """The keyword arguments given (not null), each one the optimizer takes, else a bad_option naming it."""
    given = {f: getattr(spec, f) for f in spec.__struct_fields__ if f != "type" and getattr(spec, f) is not None}
    allowed = ARGUMENTS[spec.type]
    for name in given:
        if name not in allowed:
            raise SpecError("bad_option", f"optimizer.{name}: torch.optim.{OPTIMIZERS[spec.type].__name__} takes no "
                            f"{name!r}; it takes {', '.join(allowed)}. Remove {name!r} or choose another type",
                            option=f"optimizer.{name}")
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    return given


def optimizer_slots(spec: OptimizerSpec) -> int:
    """The tensors of a parameter's size the optimizer keeps for it: SGD's momentum buffer, Adam's two moments
    (and amsgrad's maximum)."""
    if spec.type == "sgd":
        return 1 if (spec.momentum or 0) > 0 else 0
    return 3 if spec.amsgrad else 2


def make_optimizer(spec: OptimizerSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """torch.optim's optimizer over `params` (one group), with torch's own checks worded as a bad_option."""
    if not params:
        raise SpecError("bad_option", "options.freeze leaves no parameter to train; freeze fewer parameters",
                        option="options.freeze")
    kind = OPTIMIZERS[spec.type]
    try:
        return kind(params, **optimizer_arguments(spec))
    except (ValueError, TypeError) as exc:  # nesterov without momentum, a negative eps, ...
        raise SpecError("bad_option", f"optimizer: torch.optim.{kind.__name__} refused the arguments: {exc}. Fix "
                        "that argument or leave it out (torch's default)", option="optimizer") from None


def export_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: list[str],
                 counters: dict[str, int], skip: set[str] = frozenset()) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by name, metadata): copies on the CPU, each its own storage (tied weights included), so the state
    can be written while training goes on. `names` are the optimizer's parameters in its order; `counters`:
    step, accumulated, seed; `skip`: the frozen weights the worker shares (frozen.py), which are not the
    session's own state."""
    out = {f"model/{n}": _own(t) for n, t in model.state_dict().items() if n not in skip}
    state = optimizer.state_dict()
    for i, name in enumerate(names):
        for key, value in state["state"].get(i, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{name}/{key}"] = _own(value)
    by_name = dict(model.named_parameters())
    for name in names:
        grad = by_name[name].grad
        if grad is not None:
            out[f"grad/{name}"] = _own(grad)
    groups = [{k: v for k, v in g.items() if k not in _GROUP_SKIP} for g in state["param_groups"]]
    meta = {"format": FORMAT, "param_groups": msgspec.json.encode(groups).decode(),
            **{k: str(int(v)) for k, v in counters.items()}}
    return out, meta


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def import_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: list[str],
                 tensors: dict[str, torch.Tensor], meta: dict[str, str], shared: set[str] = frozenset()) -> dict[str, int]:
    """Loads what export_state wrote into `model` and `optimizer` (on their device); answers the counters. The
    `shared` frozen weights are neither in it nor written."""
    if meta.get("format") != FORMAT:
        raise SpecError("bad_weights", f"the session state is not in the {FORMAT} format (got "
                        f"{meta.get('format')!r}); it was written by another version")
    weights = {n[6:]: t for n, t in tensors.items() if n.startswith("model/") and n[6:] not in shared}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if set(missing) - set(shared) or unexpected:
        raise SpecError("bad_weights", f"the session state does not fit its model: missing "
                        f"{sorted(set(missing) - set(shared))[:4]}, unexpected {sorted(unexpected)[:4]}")
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    index = {name: i for i, name in enumerate(names)}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            name, _, field = key[6:].rpartition("/")
            per_param.setdefault(index[name], {})[field] = value
    groups = msgspec.json.decode(meta["param_groups"])
    for group in groups:
        group["params"] = list(range(len(names)))
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    by_name = dict(model.named_parameters())
    for name in names:
        grad = tensors.get(f"grad/{name}")
        by_name[name].grad = grad.to(by_name[name].device) if grad is not None else None
    return {k: int(meta[k]) for k in ("step", "accumulated", "seed")}


# Complex dtypes the safetensors format has no name for: such a tensor is written as its real view
# (torch.view_as_real: a last dimension of 2, real and imaginary parts) and named in the metadata's `complex`.
_AS_REAL = (torch.complex128, torch.complex32)


def to_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    as_real = sorted(n for n, t in tensors.items() if t.dtype in _AS_REAL)
    if as_real:
        tensors = {n: torch.view_as_real(t).contiguous() if n in as_real else t for n, t in tensors.items()}
        meta = {**meta, "complex": msgspec.json.encode(as_real).decode()}
    return save_safetensors(tensors, metadata=meta)


def from_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; safetensors' own parser reads the tensors, the header's JSON
    gives the metadata. Tensors written as their real view (to_bytes) come back complex."""
    if len(data) < 8:
        raise SpecError("bad_weights", "the session state is not a safetensors file (under 8 bytes)")
    (size,) = struct.unpack("<Q", data[:8])
    header = msgspec.json.decode(data[8:8 + size])
    tensors, meta = load_safetensors(data), dict(header.get("__metadata__") or {})
    for name in msgspec.json.decode(meta.get("complex", "[]"), type=list[str]):
        tensors[name] = torch.view_as_complex(tensors[name])
    return tensors, meta


def check_step_values(lr: float | None, dtypes) -> None:
    """A step's `lr` (or an optimizer argument at creation) finite in every dtype the session's parameters have,
    else a bad_option: torch refuses a scalar its tensor's dtype cannot hold, after the queue."""
    if lr is not None:
        _finite_in("lr", lr, dtypes)


def check_arguments(spec: OptimizerSpec, dtypes) -> None:
    """Every numeric argument of the optimizer finite in the session's dtypes (check_step_values)."""
    for name in ("lr", "momentum", "dampening", "eps", "weight_decay"):
        value = getattr(spec, name)
        if value is not None:
            _finite_in(f"optimizer.{name}", value, dtypes)


def _finite_in(where: str, value: float, dtypes) -> None:
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    for dtype in sorted(dtypes, key=lambda d: torch.finfo(d).max):  # the narrowest named
        top = torch.finfo(dtype).max
        if not math.isfinite(value) or abs(value) > top:
            raise SpecError("bad_option", f"{where} is {value!r}, beyond what the session's {dtype} weights hold "
                            f"(largest finite {top:g}): the optimizer's arithmetic would overflow. Send a finite "
                            f"value under {top:g}", option=where, value=repr(value))
