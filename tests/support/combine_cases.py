"""Requests that run as one batched computation (gradsvc/engine/combine.py) and the checks that their results
equal what each request answers alone: the engine's tests and the live stack's share them."""

from __future__ import annotations

import msgspec
import torch
from torch import nn

from tests.support.nets import SEED_A_LAYERS, TWO_LOSSES, from_wire, tensor_json

# Bit for bit where the kernels sum in the same order; the batched matmuls may not (docs/performance.md).
TOLERANCE = {"float64": dict(rtol=1e-12, atol=1e-14), "float32": dict(rtol=1e-5, atol=1e-6)}


def layer_body(i: int, dtype: str = "float64", options: dict | None = None, losses: bool = False) -> dict:
    """The 6-8-3 tanh net, its weights from seed i % 3, its own batch of 4 rows (i's)."""
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(4, 6, generator=g, dtype=getattr(torch, dtype))
    y = torch.randint(0, 3, (4,), generator=g)
    body = {"model": {"layers": SEED_A_LAYERS, "dtype": dtype, "seed": i % 3}, "inputs": tensor_json(x),
            "options": {"numcheck": "off", "encoding": "b64", **(options or {})}}
    if losses:
        teacher = torch.randn(4, 3, generator=g, dtype=getattr(torch, dtype))
        body.update(losses=TWO_LOSSES, targets={"label": tensor_json(y), "teacher": tensor_json(teacher)})
    else:
        body.update(loss="cross_entropy", targets=tensor_json(y))
    return body


def overflowing_body(dtype: str = "float32") -> dict:
    """A member of the mse group whose loss overflows (its targets are finite, their square is not): only it fails."""
    body = layer_body(0, dtype)
    body.update(loss="mse", targets=tensor_json(torch.full((4, 3), 3e38, dtype=getattr(torch, dtype))))
    return body


def mse_body(i: int, dtype: str = "float32") -> dict:
    body = layer_body(i, dtype)
    g = torch.Generator().manual_seed(2000 + i)
    body.update(loss="mse", targets=tensor_json(torch.randn(4, 3, generator=g, dtype=getattr(torch, dtype))))
    return body


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 5)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


def graph_bodies(n: int, dtype: str = "float64") -> list[dict]:
    """n requests of one exported graph (a residual MLP), each with its own weights and batch."""
    from gradclient.export import export_graph

    torch_dtype = getattr(torch, dtype)
    exported = export_graph(Residual().to(torch_dtype), torch.randn(3, 5, dtype=torch_dtype))
    graph = msgspec.to_builtins(exported.graph)
    out = []
    for i in range(n):
        torch.manual_seed(i)
        weights = {k: torch.randn_like(v) for k, v in exported.weights.items()}
        g = torch.Generator().manual_seed(3000 + i)
        model = {"graph": graph, "dtype": dtype, "weights": {k: tensor_json(v) for k, v in weights.items()}}
        out.append({"model": model,
                    "inputs": tensor_json(torch.randn(3, 5, generator=g, dtype=torch_dtype)),
                    "targets": tensor_json(torch.randn(3, 5, generator=g, dtype=torch_dtype)), "loss": "mse",
                    "options": {"numcheck": "off", "encoding": "b64"}})
    return out


def assert_equal_results(alone: dict, together: dict, dtype: str) -> None:
    """Two results (wire dicts) of one request agree: loss, losses, gradients, per-loss gradients, memory."""
    tol = TOLERANCE[dtype]
    assert abs(alone["loss"] - together["loss"]) <= tol["atol"] + tol["rtol"] * abs(alone["loss"])
    assert (alone.get("losses") or {}).keys() == (together.get("losses") or {}).keys()
    for name, a in alone["gradients"].items():
        torch.testing.assert_close(_tensor(together["gradients"][name]), _tensor(a), **tol)
    for term, grads in (alone.get("per_loss_gradients") or {}).items():
        for name, a in grads.items():
            torch.testing.assert_close(_tensor(together["per_loss_gradients"][term][name]), _tensor(a), **tol)
    assert alone.get("memory") == together.get("memory")


def _tensor(d: dict) -> torch.Tensor:
    """A wire tensor as the API answers it (list or b64), or as msgspec.to_builtins leaves an in-process result's
    raw bytes (base64 under "data")."""
    if isinstance(d.get("data"), str):
        return from_wire({"dtype": d["dtype"], "shape": d["shape"], "b64": d["data"]})
    return from_wire(d)
