"""What gradients() returns: the wire result with its tensors as torch tensors (numpy without torch).

`GradientResult` and `PerSample` here are the SDK's public names for what the API's schemas of the same
names (gradsvc.wire.GradientResult / PerSample, the OpenAPI components) carry, decoded: one concept, the
wire form and the decoded form. Inside gradclient the wire classes are only ever named `wire.<Name>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradsvc.wire import ClipResult, Density, GraphNode, Memory, NoiseScale, Norms, Numcheck, ShardsInfo, Timings

from .tensors import from_wire


@dataclass
class PerSample:
    norms: Any = None  # (batch,) per-example gradient norms
    gradients: dict[str, Any] | None = None  # {param: (batch, *param.shape)}


@dataclass
class Diagnostics:
    """result.diagnostics decoded: one entry per name asked for in diagnostics=[...]."""

    norms: Norms | None = None  # .global_ (the wire's "global"), .parameters {name: float}, .modules {path: float}
    variance: dict[str, Any] | None = None  # BackPACK's Variance per parameter
    second_moment: dict[str, Any] | None = None  # BackPACK's SumGradSquared per parameter
    noise_scale: NoiseScale | None = None  # .b_simple, .trace_covariance, .gradient_norm_squared, .reason


@dataclass
class Curvature:
    """result.curvature decoded: eigenvalues largest first with |M v - lambda v| / |lambda| each."""

    matrix: str
    top_eigenvalues: list[float]
    residuals: list[float]
    trace: float | None = None
    trace_stderr: float | None = None
    density: Density | None = None
    products: int = 0
    eigenvectors: list[dict[str, Any]] | None = None  # gradient-shaped, one {param: tensor} per eigenvalue


@dataclass
class GradientResult:
    """One computed request. Tensor fields hold torch tensors (numpy arrays when torch is absent), keyed
    by the local model's state_dict names; numcheck, memory and timings are the wire Structs."""

    loss: float
    gradients: dict[str, Any]
    timings: Timings
    numcheck: Numcheck | None = None
    memory: Memory | None = None
    job_id: str = ""
    status: str = "finished"
    device: str = ""
    dtype: str = ""
    parameter_count: int = 0
    micro_batches: int = 1
    torch_version: str = ""
    losses: dict[str, float] | None = None
    per_loss_gradients: dict[str, dict[str, Any]] | None = None
    gradient_cosine: dict[str, float] | None = None
    per_sample: PerSample | None = None
    input_gradient: Any = None
    hvp: dict[str, Any] | None = None
    graph: list[GraphNode] | None = None
    checkpoint: dict[str, float] | None = None
    shards: ShardsInfo | None = None  # how a request sent with shards=N ran (None when it was not split)
    graph_ref: str | None = None  # graph models: the service's handle on the graph (the SDK resends it for you)
    seed: int = 0  # the seed the job ran with (dropout masks): pass seed= to repeat the call exactly
    upload_bytes: int = 0  # what this call sent: the body and the weight pieces the service did not hold yet
    diagnostics: Diagnostics | None = None  # diagnostics=["norms", "variance", "second_moment", "noise_scale"]
    clip: ClipResult | None = None  # clip={"max_norm": C, ...}: .total_norm and .scale, or .clipped of .examples
    curvature: Curvature | None = None  # curvature={"top": k, "trace": True, ...}

    def summary(self) -> str:
        """A per-layer table (type, output shape, parameters, saved bytes and their share), then the numerical
        check and the timings, in torchinfo's style. `print(result)` prints it."""
        from .summary import summary

        return summary(self)

    def __str__(self) -> str:
        return self.summary()

    def plot(self, path: str | None = None):
        """Bar charts of saved bytes per layer and of the phase timings (matplotlib: the `plot` extra);
        saved to `path` when given. Returns the Figure."""
        from .summary import plot

        return plot(self, path)

    def set_grads(self, model: Any) -> None:
        """Writes the gradients into each parameter's `.grad` (as loss.backward() would), so an optimizer
        can step. Frozen parameters (no gradient) are left alone."""
        import torch

        for name, p in model.named_parameters():
            g = self.gradients.get(name)
            if g is not None:
                p.grad = g.to(device=p.device, dtype=p.dtype) if isinstance(g, torch.Tensor) else torch.as_tensor(g)


def build_result(raw: Any, local_names: dict[str, str] | None = None) -> GradientResult:
    """The SDK's result from a decoded wire result, parameter names mapped back to the local model's."""
    names = local_names or {}

    def tensors(d: dict | None) -> dict | None:
        return None if d is None else {names.get(k, k): from_wire(v) for k, v in d.items()}

    ps = raw.per_sample
    return GradientResult(
        loss=raw.loss, gradients=tensors(raw.gradients), timings=raw.timings, numcheck=raw.numcheck,
        memory=raw.memory, job_id=raw.job_id, status=raw.status, device=raw.device, dtype=raw.dtype,
        parameter_count=raw.parameter_count, micro_batches=raw.micro_batches, torch_version=raw.torch_version,
        losses=raw.losses,
        per_loss_gradients=None if raw.per_loss_gradients is None else
        {k: tensors(v) for k, v in raw.per_loss_gradients.items()},
        gradient_cosine=raw.gradient_cosine,
        per_sample=None if ps is None else PerSample(norms=from_wire(ps.norms), gradients=tensors(ps.gradients)),
        input_gradient=from_wire(raw.input_gradient), hvp=tensors(raw.hvp), graph=raw.graph,
        checkpoint=raw.checkpoint, shards=raw.shards, graph_ref=raw.graph_ref, seed=raw.seed,
        diagnostics=_diagnostics(raw.diagnostics, names, tensors), clip=raw.clip,
        curvature=_curvature(raw.curvature, tensors),
    )


def _diagnostics(raw: Any, names: dict[str, str], tensors) -> Diagnostics | None:
    if raw is None:
        return None
    norms = raw.norms
    if norms is not None and names:
        norms = Norms(global_=norms.global_, parameters={names.get(k, k): v for k, v in norms.parameters.items()},
                      modules=norms.modules)
    return Diagnostics(norms=norms, variance=tensors(raw.variance), second_moment=tensors(raw.second_moment),
                       noise_scale=raw.noise_scale)


def _curvature(raw: Any, tensors) -> Curvature | None:
    if raw is None:
        return None
    return Curvature(matrix=raw.matrix, top_eigenvalues=raw.top_eigenvalues, residuals=raw.residuals,
                     trace=raw.trace, trace_stderr=raw.trace_stderr, density=raw.density, products=raw.products,
                     eigenvectors=None if raw.eigenvectors is None else [tensors(v) for v in raw.eigenvectors])
