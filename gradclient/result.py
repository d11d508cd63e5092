"""What gradients() returns: the wire result with its tensors as torch tensors (numpy without torch).

`GradientResult` and `PerSample` here are the SDK's public names for what the API's schemas of the same
names (gradsvc.wire.GradientResult / PerSample, the OpenAPI components) carry, decoded: one concept, the
wire form and the decoded form. Inside gradclient the wire classes are only ever named `wire.<Name>`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import msgspec

from gradsvc import wire
from gradsvc.wire import (
    ClipResult,
    Density,
    GraphNode,
    Memory,
    NoiseScale,
    Norms,
    Numcheck,
    ShardsInfo,
    Timings,
)

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
    trace_samples: list[float] | None = None  # Hutchinson's z^T M z per probe, in probe order


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
    # Graph models: the new value of each buffer forward wrote (batch norm's running statistics), by state_dict
    # name; gradients() has written them into the module already unless called with update_buffers=False.
    buffers: dict[str, Any] | None = None
    # options outputs=True: what forward returned (the same tuple, dict or ModelOutput), as tensors.
    outputs: Any = None
    # How the module was captured: "export" (one graph for any batch size), "export_static" (this batch size),
    # "draft" (each data-dependent branch as this call took it; captured again on every call) or "trace" (the
    # ATen program the forward ran on this batch, reused while its guards hold): docs/training-code.md. The
    # service's answer, which echoes the graph's (wire GraphSpec.capture); None for a layer spec.
    capture: str | None = None
    # What that capture is specialised to, its guards: None for "export"; the inputs' shapes and dtypes
    # ("inputs"); for "trace" also the values Python read from tensors ("values"), the sizes of data-dependent
    # outputs ("sizes") and the constants made in forward ("constants"): wire Specialised, as a dict.
    specialised: dict[str, Any] | None = None
    diagnostics: Diagnostics | None = None  # diagnostics=["norms", "variance", "second_moment", "noise_scale"]
    clip: ClipResult | None = None  # clip={"max_norm": C, ...}: .total_norm and .scale, or .clipped of .examples
    curvature: Curvature | None = None  # curvature={"top": k, "trace": True, ...}
    math_mode: str = "ieee"  # the float32 math the job ran in: "ieee", or "tf32" where asked on a GPU that has it
    # "resident" when the worker held the model from an earlier call (only what changed was copied in), "built" when
    # it built it for this call; copied_bytes: the bytes copied into the model on the worker's device.
    prepared: str | None = None
    copied_bytes: int | None = None
    combined: int | None = None  # k: computed as one with k - 1 other jobs of a worker's take; None: alone

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
        buffers=tensors(raw.buffers), outputs=decode_tree(raw.outputs), capture=getattr(raw, "capture", None),
        specialised=_specialised(getattr(raw, "specialised", None)),
        diagnostics=_diagnostics(raw.diagnostics, names, tensors), clip=raw.clip,
        curvature=_curvature(raw.curvature, tensors), math_mode=raw.math_mode,
        prepared=raw.prepared, copied_bytes=raw.copied_bytes, combined=raw.combined,
    )


def _specialised(s: Any) -> dict[str, Any] | None:
    """The wire's Specialised (a capture's guards) as the dict `result.specialised` is, every key present."""
    if s is None:
        return None
    return {"inputs": [{"shape": list(i.shape), "dtype": i.dtype} for i in s.inputs], "values": dict(s.values),
            "sizes": {k: list(v) for k, v in s.sizes.items()}, "constants": list(s.constants)}


def decode_tree(value: Any) -> Any:
    """result.outputs as decoded (tensors as maps inside an untyped field) with each tensor converted."""
    if isinstance(value, wire.Tensor):
        return from_wire(value)
    if wire.is_tensor(value):
        return from_wire(msgspec.convert(value, wire.Tensor))
    if isinstance(value, list):
        return [decode_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: decode_tree(v) for k, v in value.items()}
    return value


def written_back(out: Any, result: GradientResult) -> None:
    """After a graph model's call: how it was captured, its outputs in forward's own structure (tuples,
    ModelOutput), and the buffers its forward wrote copied into the module (as a local step leaves them)."""
    export = out.export
    if result.capture is None:  # a service that does not echo the graph's capture: the SDK's own record
        result.capture, result.specialised = export.capture, export.specialised
    result.outputs = structured(export, result.outputs)
    if result.buffers and out.module is not None:
        import torch

        from .module_state import set_states

        # buffers, and tensor attributes a recorded forward wrote
        set_states(out.module, {name: torch.as_tensor(value) for name, value in result.buffers.items()})


def structured(export: Any, outputs: Any) -> Any:
    """A graph model's outputs as the service lists them, in forward's own structure (tuples, ModelOutput)
    where the capture knows it."""
    if outputs is None or export is None or export.out_spec is None or export.graph.output_tree is None:
        return outputs
    from torch.utils import _pytree as pytree

    found: dict[int, Any] = {}
    _pair(export.graph.output_tree, outputs, found)
    if len(found) != export.out_spec.num_leaves:
        return outputs
    return pytree.tree_unflatten([found[i] for i in range(len(found))], export.out_spec)


def _pair(tree: Any, value: Any, found: dict[int, Any]) -> None:
    if isinstance(tree, bool) or tree is None:
        return
    if isinstance(tree, int):
        found[tree] = value
    elif isinstance(tree, list) and isinstance(value, list):
        for t, v in zip(tree, value):
            _pair(t, v, found)
    elif isinstance(tree, dict) and isinstance(value, dict):
        for k, t in tree.items():
            _pair(t, value.get(k), found)


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
                     eigenvectors=None if raw.eigenvectors is None else [tensors(v) for v in raw.eigenvectors],
                     trace_samples=raw.trace_samples)


# A result this large (its answer's bytes) that gradients() returned is released with the client's next
# POST /gradients (wire.RELEASE_HEADER): the service drops it then rather than keep it GRADSVC_RESULT_TTL_S
# (a training loop's results would fill its memory). Smaller ones cost little to keep.
# Client(release_results=False) keeps all.
RELEASE_MIN_BYTES = 1 << 20


class HeldResults:
    """The large results a client's gradients() returned, which its next POST /gradients releases."""

    def __init__(self) -> None:
        self.job_ids: list[str] = []
        self.lock = threading.Lock()

    def take(self) -> list[str]:
        """The job ids to release with this request; none is released twice."""
        with self.lock:
            held, self.job_ids = self.job_ids, []
        return held

    def add(self, job_id: str | None, answer_bytes: int) -> None:
        if answer_bytes >= RELEASE_MIN_BYTES and job_id:
            with self.lock:
                self.job_ids = [*self.job_ids, job_id][-wire.MAX_RELEASED:]
