"""Reference nets from the seed articles, as specs and as local PyTorch modules."""

from __future__ import annotations

import torch
from torch import nn

SEED_A_LAYERS = [
    {"type": "Linear", "in_features": 6, "out_features": 8},
    {"type": "Tanh"},
    {"type": "Linear", "in_features": 8, "out_features": 3},
]


def seed_a_module(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def seed_a_batch(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


# Two loss terms over one graph, each reading its own target (the sharding and reduction tests' case).
TWO_LOSSES = [{"name": "task", "type": "cross_entropy", "weight": 1.0, "target": "label"},
              {"name": "distill", "type": "mse", "weight": 0.5, "target": "teacher"}]


def seed_a_body(options: dict | None = None) -> dict:
    """The 6-8-3 tanh float64 net on seed_a_batch()'s 4 rows, as a JSON request body."""
    x, y = seed_a_batch()
    return {"model": {"layers": SEED_A_LAYERS, "dtype": "float64", "seed": 0}, "inputs": x.tolist(),
            "targets": y.tolist(), "loss": "cross_entropy", "options": options or {}}


def wide_stack_layers(depth: int, width: int = 1024) -> list[dict]:
    layers: list[dict] = []
    for _ in range(depth):
        layers += [{"type": "Linear", "in_features": width, "out_features": width}, {"type": "ReLU"}]
    return layers


def tensor_json(t: torch.Tensor) -> dict:
    import base64

    t = t.contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "b64": base64.b64encode(t.numpy().tobytes()).decode()}


def from_wire(d: dict) -> torch.Tensor:
    import base64

    dtype = getattr(torch, d["dtype"])
    if "b64" in d:
        raw = base64.b64decode(d["b64"])
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(d["shape"]) if raw else torch.empty(d["shape"], dtype=dtype)
    return torch.tensor(d["data"], dtype=dtype).reshape(d["shape"])


# A BatchNorm/ReLU/max-pool CNN: on a GPU whose cuDNN runs float32 convolutions in TF32 (CUDA's default) its
# float32 gradient drifts past the float32 tolerance; the worker's default "ieee" math keeps it within.
BN_CNN_LAYERS = [
    {"type": "Conv2d", "in_channels": 3, "out_channels": 8, "kernel_size": 3, "padding": 1},
    {"type": "BatchNorm2d", "num_features": 8}, {"type": "ReLU"}, {"type": "MaxPool2d", "kernel_size": 2},
    {"type": "Conv2d", "in_channels": 8, "out_channels": 16, "kernel_size": 3, "padding": 1},
    {"type": "BatchNorm2d", "num_features": 16}, {"type": "ReLU"}, {"type": "MaxPool2d", "kernel_size": 2},
    {"type": "Flatten"}, {"type": "Linear", "in_features": 16 * 4 * 4, "out_features": 10},
]


def bn_cnn_batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """n images of 3x16x16 and their classes (of 10), float32."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


# A tensor of 2^30 float32 elements (4 GiB): the Upsample's output and each Tanh's, which autograd saves.
HUGE_ELEMENTS = 1 << 30


def oom_request(device_bytes: int, elements: int = HUGE_ELEMENTS):
    """A job whose saved activations add up past `device_bytes` (the card's total memory): 1,024 inputs
    upsampled to `elements`, then enough Tanh layers, each keeping a float32 output of that size, to need more
    than the card has, averaged to one number at the end. Its input is 4 KiB, so it is built on any host; the
    limits are raised so that nothing refuses it before it runs."""
    import msgspec  # here, not at the top: the SDK's tests import this module without the engine

    from gradsvc.engine import EngineConfig, Limits
    from gradsvc.wire import GradientRequest

    tanhs = device_bytes // (4 * elements) + 2
    layers = [{"type": "Linear", "in_features": 1024, "out_features": 1024},
              {"type": "Upsample", "scale_factor": float(elements // 1024)}, *[{"type": "Tanh"}] * tanhs,
              {"type": "AdaptiveAvgPool1d", "output_size": 1}, {"type": "Flatten"}]
    req = msgspec.convert({"model": {"layers": layers, "dtype": "float32"}, "inputs": tensor_json(torch.randn(1, 1, 1024)),
                           "targets": tensor_json(torch.zeros(1, 1)), "loss": "mse",
                           "options": {"numcheck": "off", "memory": False}}, GradientRequest)
    return req, EngineConfig(limits=Limits(max_elements=2 * elements, max_layers=tanhs + 8))
