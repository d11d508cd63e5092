"""Curvature of the loss over the trainable parameters, from matrix-vector products of the Hessian (double
backward) or the generalised Gauss-Newton matrix J^T H_out J (through the model's output, J never formed):
the top eigenvalues by Lanczos with their residuals, the Hutchinson trace with its standard error, and the
stochastic Lanczos quadrature density, which shares the trace's Rademacher probes."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import msgspec
import torch

from gradsvc.wire import Curvature, CurvatureOptions, Density

from .. import tensors
from ..devices import is_random, seeded
from ..errors import SpecError
from ..passes import chunks, forward
from ..prepared import Prepared
from ..quantities import twice_differentiable
from .lanczos import density_steps, lanczos, quadrature, top_ritz, top_steps

# Hutchinson's probes when only the trace is asked for.
DEFAULT_PROBES = 100
class Products:
    """M v for flat float64 vectors v over the trainable parameters, from one forward and backward kept
    for every product; `count` says how many were computed."""

    def __init__(self, prep: Prepared, params: dict[str, torch.Tensor], matrix: str) -> None:
        self.params = params
        self.shapes = [p.shape for p in params.values()]
        self.size = sum(p.numel() for p in params.values())
        self.count = 0
        self.progress, self.total = None, 0  # the job's progress callback and the products it expects at most
        chunk = next(iter(chunks(_whole_batch(prep))))
        out, _, total = forward(prep, chunk)
        leaves = list(params.values())
        if matrix == "hessian":
            self.grads = torch.autograd.grad(total, leaves, create_graph=True, materialize_grads=True)
            self._apply = self._hessian
        else:
            self.out = out
            self.out_grad = torch.autograd.grad(total, out, create_graph=True)[0]  # dL/d out, kept differentiable
            self.dual = torch.zeros_like(out, requires_grad=True)  # J^T u is linear in u: its derivative is J
            self.jt_dual = torch.autograd.grad(out, leaves, self.dual, create_graph=True, materialize_grads=True)
            self._apply = self._ggn

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        self.count += 1
        if self.progress is not None:
            self.progress("curvature", min(self.count, self.total), self.total)
        pieces = self._split(v)
        out = self._apply(pieces)
        # Lanczos keeps its basis on the CPU in float64: P x steps numbers, beside products that dominate
        return torch.cat([o.reshape(-1).to("cpu", torch.float64) for o in out])

    def _split(self, v: torch.Tensor) -> list[torch.Tensor]:
        parts, i = [], 0
        for p in self.params.values():
            parts.append(v[i:i + p.numel()].reshape(p.shape).to(p.device, p.dtype))
            i += p.numel()
        return parts

    def _hessian(self, v: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(self.grads, list(self.params.values()), v, retain_graph=True,
                                   materialize_grads=True)

    def _ggn(self, v: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        jv = torch.autograd.grad(self.jt_dual, self.dual, v, retain_graph=True)[0]  # J v, shaped like the output
        hjv = torch.autograd.grad(self.out_grad, self.out, jv, retain_graph=True)[0]  # H_out J v
        return torch.autograd.grad(self.out, list(self.params.values()), hjv, retain_graph=True,
                                   materialize_grads=True)


def _whole_batch(prep: Prepared) -> Prepared:
    """The prepared request with the whole batch as one chunk (micro_batch bounds the gradient's memory,
    but every product here runs over the graph of the whole batch)."""
    if prep.options.micro_batch is None:
        return prep
    return dataclasses.replace(prep, options=msgspec.structs.replace(prep.options, micro_batch=None))


def curvature(prep: Prepared, params: dict[str, torch.Tensor], device: torch.device, seed: int,
              progress=None) -> Curvature:
    """What options.curvature asks for, on the whole batch, the model's buffers left as they were; `progress`
    (phase, done, total) hears of each product."""
    opts = prep.options.curvature
    saved = {n: b.detach().clone() for n, b in prep.model.named_buffers()}
    try:
        with seeded(seed, device, is_random(prep.model)), twice_differentiable(True):
            return _curvature(prep, params, opts, progress)
    except RuntimeError as exc:
        if "not implemented" not in str(exc) and "does not require grad" not in str(exc):
            raise
        raise SpecError("bad_option", f"options.curvature: torch cannot differentiate this model twice "
                        f"({str(exc).splitlines()[0][:200]}), so its {opts.matrix} products are not available; "
                        "remove options.curvature", option="curvature") from None
    finally:
        with torch.no_grad():
            for n, b in prep.model.named_buffers():
                b.copy_(saved[n])


def _curvature(prep: Prepared, params: dict[str, torch.Tensor], opts: CurvatureOptions, progress=None) -> Curvature:
    products = Products(prep, params, opts.matrix)
    size = products.size
    if progress is not None:
        probes = (opts.probes or DEFAULT_PROBES) if opts.trace or opts.density else 0
        products.progress = progress
        products.total = ((top_steps(opts, size) + opts.top if opts.top else 0)
                          + probes * (density_steps(opts, size) if opts.density else 1))
    result = Curvature(matrix=opts.matrix)
    gen = torch.Generator().manual_seed(opts.seed)
    if opts.top:
        steps = top_steps(opts, size)
        values, vectors, _ = top_ritz(products, size, opts.top, steps, opts.tolerance, gen)
        result.top_eigenvalues = values.tolist()
        result.residuals = [_residual(products, lam, v) for lam, v in zip(values.tolist(), vectors)]
        if opts.eigenvectors:
            result.eigenvectors = [_as_parameters(products, v, prep.dtype) for v in vectors]
    if opts.trace or opts.density:
        _probe(products, opts, result)
    result.products = products.count
    if progress is not None:  # Lanczos stopped early: done
        progress("curvature", products.total, products.total)
    return result


def _residual(products: Products, lam: float, v: torch.Tensor) -> float:
    """|M v - lambda v| / |lambda| with one more product: the check each eigenvalue carries."""
    return float((products(v) - lam * v).norm()) / max(abs(lam), 1e-300)


def _as_parameters(products: Products, v: torch.Tensor, dtype: torch.dtype) -> dict:
    return {n: tensors.encode(p.to(dtype)) for n, p in zip(products.params, products._split(v))}


def probe_vector(seed: int, index: int, size: int) -> torch.Tensor:
    """Rademacher probe `index` of `seed`: (size,) of +-1 in float64, from a generator of its own seeded by a
    hash of (seed, index), so any range of probes is drawn without drawing the ones before it."""
    digest = hashlib.blake2b(f"gradsvc-probe:{seed}:{index}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.randint(0, 2, (size,), generator=gen, dtype=torch.float64) * 2 - 1


def trace_estimate(samples: list[float]) -> tuple[float, float | None]:
    """Hutchinson's estimate from its per-probe samples z^T M z: their mean and its standard error."""
    t = torch.tensor(samples, dtype=torch.float64)
    stderr = float(t.std(unbiased=True)) / math.sqrt(len(samples)) if len(samples) > 1 else None
    return float(t.mean()), stderr


def _probe(products: Products, opts: CurvatureOptions, result: Curvature) -> None:
    """Hutchinson over Rademacher probes z (z^T M z each); with density, each probe also starts a Lanczos
    run whose first diagonal entry is z^T M z / P, so the density's mean is the trace / P exactly."""
    size = products.size
    probes = opts.probes or DEFAULT_PROBES
    samples: list[float] = []
    nodes: list[float] = []
    weights: list[float] = []
    steps = density_steps(opts, size)
    for index in range(opts.first_probe, opts.first_probe + probes):
        z = probe_vector(opts.seed, index, size)  # (P,) of +-1
        if opts.density:
            state = lanczos(products, z, steps)
            samples.append(size * state.alpha[0])
            theta, w = quadrature(state)
            nodes += theta
            weights += [x / probes for x in w]
        else:
            samples.append(float(z @ products(z)))
    if opts.trace:
        result.trace, result.trace_stderr = trace_estimate(samples)
        result.trace_samples = samples
    if opts.density:
        result.density = Density(eigenvalues=nodes, weights=weights)
