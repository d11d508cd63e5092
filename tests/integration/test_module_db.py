"""Conformance with torch's own module tests: every sample (with a batch dimension) that
`torch.testing._internal.common_modules.module_db` keeps for an allow-listed class goes through
`POST /gradients` of a live stack as a one-layer spec, with the module's weights and the sample as the
batch, and the gradients must equal local autograd in float64. Samples the service cannot take get a
coded 4xx, never a 500. The allow-listed classes module_db lacks get a sample of their own (EXTRA)."""

from __future__ import annotations

import inspect
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing._internal import common_modules  # needs expecttest (a dev dependency)

from gradsvc.layers import LAYERS, ArgumentError, canonical
from gradsvc.modules import layer_class

from tests.support.nets import from_wire, tensor_json

MIN_CLASSES = 45
TOL = 1e-9


@dataclass
class Case:
    name: str
    body: dict
    expect: str  # "gradients", or the error code the service must answer
    grads: dict[str, torch.Tensor]
    input_grad: torch.Tensor | None = None


def _wire_value(v):
    if isinstance(v, (tuple, list)):
        return [_wire_value(x) for x in v]
    if callable(v):  # TransformerEncoderLayer's activation=F.gelu: the spec names it
        return v.__name__
    return v


def _spec(cls: type[nn.Module], args: tuple, kwargs: dict) -> dict:
    """The constructor call as a user writes it in a spec: every given argument by keyword."""
    if args:
        bound = inspect.signature(cls).bind(*args, **kwargs)
        kwargs = {**bound.arguments, **bound.arguments.pop("kwargs", {})}
    return {"type": cls.__name__, **{k: _wire_value(v) for k, v in kwargs.items()}}


def _batched(info, sample) -> torch.Tensor | None:
    """The sample's single input, when it has a batch dimension. The recurrent samples are all unbatched
    (sequence, features): two copies of the sequence, the second scaled, make a batch of 2."""
    fwd = sample.forward_input
    if fwd is None:
        return None
    args = list(fwd.args) + [v for k, v in fwd.kwargs.items() if k == "input"]
    if len(args) != 1 or any(k != "input" and v is not None for k, v in fwd.kwargs.items()):
        return None
    x = args[0]
    if not isinstance(x, torch.Tensor) or "no_batch_dim" in sample.desc or x.dim() == 0:
        return None
    if issubclass(info.module_cls, nn.RNNBase):
        if x.dim() != 2:
            return None
        first = sample.constructor_input.kwargs.get("batch_first", False)
        return torch.stack([x, 0.5 * x], dim=0 if first else 1)
    return x


def _case(info, sample, index: int) -> Case | None:
    x = _batched(info, sample)
    if x is None:
        return None
    cls, args, kwargs = info.module_cls, sample.constructor_input.args, sample.constructor_input.kwargs
    return _layer_case(cls, args, kwargs, x, index, f"{cls.__name__}[{index}:{sample.desc or '-'}]")


def _layer_case(cls: type[nn.Module], args: tuple, kwargs: dict, x: torch.Tensor, index: int, label: str) -> Case:
    name = cls.__name__
    spec = _spec(cls, args, kwargs)
    torch.manual_seed(index)
    module = layer_class(name)(*args, **kwargs).double()
    weights = {f"0.{k}": tensor_json(v) for k, v in module.state_dict().items()}
    x = x.detach().clone() if not x.dtype.is_floating_point else x.detach().clone().double()
    body = {"model": {"layers": [spec], "dtype": "float64", "weights": weights}, "inputs": tensor_json(x),
            "loss": "mse", "options": {"numcheck": "off", "memory": False}}
    try:
        canonical(name, {k: v for k, v in spec.items() if k != "type"})
    except ArgumentError:  # return_indices=True: a tuple cannot flow through a stack
        body["targets"] = tensor_json(torch.zeros(x.shape[0], dtype=torch.float64))
        return Case(label, body, "unknown_layer", {})
    if x.shape[0] == 0:
        body["targets"] = tensor_json(torch.zeros(0, dtype=torch.float64))
        return Case(label, body, "bad_tensor", {})
    params = dict(module.named_parameters())
    xs = x.requires_grad_(True) if not params and x.dtype.is_floating_point else x
    torch.manual_seed(0)  # the service draws dropout masks from the request's seed (0)
    out = module(xs)
    target = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(index))
    body["targets"] = tensor_json(target)
    if not params:
        body["options"]["input_grad"] = True
    if not torch.isfinite(out).all():
        return Case(label, body, "non_finite", {})
    loss = F.mse_loss(out, target)
    leaves = [*params.values(), *([xs] if not params else [])]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    named = {f"0.{k}": g for k, g in zip(params, grads)}
    if not params:
        return Case(label, body, "gradients", {}, grads[-1])
    return Case(label, body, "gradients", named)


# Allow-listed classes module_db has no entry for: one sample each, checked the same way.
EXTRA = [(nn.Upsample, {"scale_factor": 2}, (2, 3, 4, 5)),
         (nn.Upsample, {"size": [5, 7], "mode": "bilinear", "align_corners": True}, (2, 3, 4, 5)),
         (nn.Upsample, {"scale_factor": 1.5, "mode": "trilinear"}, (2, 1, 2, 4, 4)),
         (nn.PixelShuffle, {"upscale_factor": 2}, (2, 8, 3, 3)), (nn.PixelUnshuffle, {"downscale_factor": 2}, (2, 2, 4, 6)),
         (nn.Unflatten, {"dim": 1, "unflattened_size": (2, -1)}, (3, 6)), (nn.Flatten, {"start_dim": 2}, (2, 3, 4, 5)),
         (nn.Identity, {}, (2, 3)), (nn.Hardsigmoid, {}, (2, 3, 5)),
         (nn.Dropout, {"p": 0.3}, (4, 6)), (nn.Dropout1d, {}, (2, 4, 5)), (nn.Dropout2d, {"p": 0.4}, (2, 4, 3, 3)),
         (nn.Dropout3d, {}, (2, 4, 2, 2, 2)), (nn.AlphaDropout, {"p": 0.2}, (4, 6)),
         (nn.FeatureAlphaDropout, {"p": 0.2}, (2, 4, 3, 3))]


def _cases() -> tuple[list[Case], set[str]]:
    cases, classes, seen = [], set(), 0
    for info in common_modules.module_db:
        name = info.module_cls.__name__
        if name not in LAYERS or getattr(nn, name, None) is not info.module_cls:
            continue
        classes.add(name)
        samples = info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=False,
                                          training=True)
        for sample in samples:
            case = _case(info, sample, seen)
            seen += 1
            if case is not None:
                cases.append(case)
    for i, (cls, kwargs, shape) in enumerate(EXTRA):
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        cases.append(_layer_case(cls, (), kwargs, x, seen + i, f"{cls.__name__}[extra {i}]"))
    return cases, classes


def test_module_db_samples_get_torchs_gradients_through_the_api(http, stack):
    cases, classes = _cases()
    print(f"\nmodule_db: {len(classes)} allow-listed classes, {len(cases) - len(EXTRA)} samples with a batch "
          f"dimension, and {len(EXTRA)} samples for the {len(LAYERS) - len(classes)} classes module_db lacks")
    assert len(classes) >= MIN_CLASSES, sorted(classes)
    compared = {c.name.split("[")[0] for c in cases if c.expect == "gradients"}
    assert compared >= classes, f"classes without a compared sample: {sorted(classes - compared)}"
    assert compared == set(LAYERS), f"allow-listed classes never compared: {sorted(set(LAYERS) - compared)}"

    def send(case: Case):
        return http.post("/gradients?wait=120", content=json.dumps(case.body).encode(),
                         headers={"content-type": "application/json"})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(send, cases))
    failures = []
    for case, r in zip(cases, responses):
        if case.expect != "gradients":
            body = r.json()
            if r.status_code != 422 or body.get("error", {}).get("code") != case.expect:
                failures.append(f"{case.name}: expected 422 {case.expect}, got {r.status_code} {r.text[:300]}")
            continue
        if r.status_code != 200:
            failures.append(f"{case.name}: {r.status_code} {r.text[:300]}")
            continue
        result = r.json()
        got = {k: from_wire(v) for k, v in result["gradients"].items() if v is not None}
        if set(got) != set(case.grads):
            failures.append(f"{case.name}: parameters {sorted(got)} != {sorted(case.grads)}")
            continue
        for k, want in case.grads.items():
            if not torch.allclose(got[k], want, rtol=TOL, atol=TOL):
                failures.append(f"{case.name}: {k} differs by {(got[k] - want).abs().max().item():.3g}")
        if case.input_grad is not None:
            g = from_wire(result["input_gradient"])
            if not torch.allclose(g, case.input_grad, rtol=TOL, atol=TOL):
                failures.append(f"{case.name}: input gradient differs by {(g - case.input_grad).abs().max():.3g}")
    assert not failures, "\n".join(failures)
    print(f"module_db: {sum(c.expect == 'gradients' for c in cases)} samples matched local autograd to {TOL}; "
          f"{sum(c.expect != 'gradients' for c in cases)} refused with the expected 4xx")


def test_get_layers_lists_each_type_with_defaults_and_ranges_as_the_checkers_enforce_them(http, stack):
    listed = {entry["type"]: entry for entry in http.get("/layers").json()}
    assert set(listed) == set(LAYERS) | {"Sequential", "Residual"}
    assert listed["BatchNorm1d"]["details"]["momentum"] == {"kind": "number | null", "required": False,
                                                            "default": 0.1, "range": ""}
    assert listed["AvgPool2d"]["details"]["divisor_override"]["default"] is None
    assert listed["Softmax"]["details"]["dim"] == {"kind": "int | null", "required": False, "default": None,
                                                   "range": ""}
    assert listed["GRU"]["output"] == "sequence" and listed["Linear"]["output"] == "tensor"
    for kind, layer in LAYERS.items():
        for name, arg in layer.args.items():
            row = listed[kind]["details"][name]
            assert (row["kind"], row["required"], row["range"]) == (arg.kind, arg.required, arg.range), (kind, name)
            if not arg.required:
                assert row["default"] == arg.default, (kind, name)
                arg.check(row["default"])  # torch's default is a value the checker accepts
