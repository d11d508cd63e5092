"""The extra quantities besides the gradients, each computed and checked here: H v (hessian_vector, by
double backward through create_graph gradients, along hvp_vector), per-example gradients
(per_sample_gradients, torch.func's vmap of grad), and (in passes.py, one more leaf of the backward) the
input's gradient. Their checks (Numcheck.quantities), each its own way:

- `hvp`: central differences of float64 autograd gradients along the vector, against H v as returned.
- `input_gradient`: central differences of the float64 loss along a random unit direction of the input,
  against the returned input gradient . direction.
- `per_sample`: the per-example gradients summed (sum losses) or averaged (mean losses) against the
  batch gradient as returned: the identity Opacus and BackPACK users rely on.
- `per_loss`: each loss's gradient as returned against that loss's own float64 autograd gradient.

Tensors are compared by numcheck's rule (relative to the tensor's scale, or under tolerance x the largest
element of the reference: a tensor small beside the rest is not judged by its own noise).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from gradsvc.wire import GradientRequest, PerSample, QuantityCheck

from . import tensors
from .config import EngineConfig
from .devices import is_allocation_failure, is_random, seeded, sync
from .errors import SpecError
from .numcheck.tolerances import F64_EPS, FLOOR_ROUNDINGS, returned_check, verdict
from .prepared import Prepared


# --- computed -------------------------------------------------------------------------------------

def hessian_vector(grads: list[torch.Tensor], params: dict[str, torch.Tensor],
                   vector: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """H v by double backward through gradients taken with create_graph=True."""
    names = list(params)
    try:
        hv = torch.autograd.grad(grads, list(params.values()), grad_outputs=[vector[n] for n in names],
                                 materialize_grads=True)
    except RuntimeError as exc:
        if "not implemented" not in str(exc):
            raise
        raise SpecError("bad_option", f"options.hvp: torch cannot differentiate this model twice "
                        f"({str(exc).splitlines()[0][:200]}), so H v is not available for it; remove options.hvp")
    return dict(zip(names, hv))


def twice_differentiable(on: bool):
    """Attention through its math kernel when H v is asked for: the fused CPU/CUDA kernels have no
    double backward, the math one is made of ops that do."""
    if not on:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])



def hvp_vector_for(request: GradientRequest, params: dict[str, torch.Tensor], config: EngineConfig):
    """The vector v of H v (names and shapes were checked by prepare)."""
    spec = request.options.hvp
    if spec is None:
        return None
    if isinstance(spec.vector, str):
        gen = torch.Generator().manual_seed(spec.seed)
        return {n: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device, p.dtype)
                for n, p in params.items()}
    return {name: tensors.decode(spec.vector[name], where=f"options.hvp.vector[{name!r}]",
                                 max_elements=config.limits.max_elements).to(p.device, p.dtype)
            for name, p in params.items()}


@dataclass
class Examples:
    """What the per-example pass gives: the per-sample answer; the examples' gradients summed or averaged
    (as the losses reduce) in float64, for the check, when asked; each loss rebuilt from the examples'
    own (the whole answer when options.batch_gradient is false), and the pass's seconds."""

    per_sample: PerSample
    summed: dict[str, torch.Tensor] | None
    losses: dict[str, float]
    seconds: float
    gradients: dict[str, torch.Tensor] | None = None  # each example's own loss gradient, (batch, *shape)


def per_sample_gradients(prep: Prepared, params: dict[str, torch.Tensor], seed: int, device: torch.device,
                         summed: bool = True) -> Examples:
    """The per-example gradients (norms, or all of them) by torch.func's vmap of grad, their sum or mean
    when `summed`, and the losses."""
    from torch.func import functional_call, grad, vmap

    consts = {n: p.detach() for n, p in prep.model.named_parameters() if n not in params}
    consts.update(dict(prep.model.named_buffers()))
    names = [t.name for t in prep.terms]
    batch = prep.inputs
    n, k = batch.rows, prep.rows_per_example or 1

    def loss_one(ps, xs1, *tgts):  # one example: its rows of the batched inputs, the others whole
        xs = tuple(x.unsqueeze(0) if b else x for x, b in zip(xs1, batch.batched))
        out = functional_call(prep.model, {**ps, **consts}, xs)
        values = [t(out, tg) for t, tg in zip(prep.terms, tgts)]
        total = sum(t.weight * v for t, v in zip(prep.terms, values))
        return total, torch.stack([v.detach() for v in values])

    detached = {n: p.detach() for n, p in params.items()}
    in_inputs = tuple(0 if b else None for b in batch.batched)
    per_example = [prep.targets[name].reshape(n, k, *prep.targets[name].shape[1:]) for name in names]  # (n, k, ...)
    sync(device)
    started = time.perf_counter()
    with seeded(seed, device, is_random(prep.model)):
        try:
            grads, values = vmap(grad(loss_one, has_aux=True), in_dims=(None, in_inputs, *([0] * len(names))),
                                 randomness="different")(detached, batch.tensors, *per_example)
        except (RuntimeError, ValueError, TypeError) as exc:
            if prep.graph is None or is_allocation_failure(exc):
                raise
            raise SpecError("bad_option", f"options.per_sample: torch.func cannot vectorise this graph over its "
                            f"examples ({str(exc).strip().splitlines()[0][:200]}); set per_sample='off'") from None
        # the norm of every example's whole gradient, no squared copy of the gradients written
        norms = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.reshape(n, -1), dim=1)
                                                      for g in grads.values()]), dim=0)  # (batch,)
        sync(device)
    seconds = time.perf_counter() - started
    full = prep.options.per_sample == "full"
    mean = prep.terms[0].reduction == "mean"
    sums = None
    if summed:
        sums = {n: (g.to(torch.float64).mean(0) if mean else g.to(torch.float64).sum(0)) for n, g in grads.items()}
    losses = {t.name: float(values[:, j].mean() if t.reduction == "mean" else values[:, j].sum())
              for j, t in enumerate(prep.terms)}
    return Examples(PerSample(norms=tensors.encode(norms),
                              gradients={n: tensors.encode(g) for n, g in grads.items()} if full else None),
                    sums, losses, seconds, gradients=grads)


# --- checked --------------------------------------------------------------------------------------


def _tensors(how: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tolerance: float) -> QuantityCheck:
    """numcheck.returned_check's rule at `tolerance`, zero judged at the rounding of `got`'s dtype."""
    dtype = next(iter(got.values())).dtype if got else torch.float64
    r = returned_check(got, want, dtype if dtype.is_floating_point else torch.float64, tolerance=tolerance)
    return QuantityCheck(how=how, max_rel_error=r.max_rel_error, tolerance=tolerance, passed=r.passed)


def per_loss(per_term: dict[str, dict[str, torch.Tensor]], reference: dict[str, dict[str, torch.Tensor]],
             tolerance: float) -> QuantityCheck:
    """Each loss's returned gradients against its own float64 autograd gradients (the worst loss counts)."""
    checks = [_tensors("", per_term[t], reference[t], tolerance) for t in per_term]
    return QuantityCheck(how="each loss's gradients against its own float64 autograd gradients",
                         max_rel_error=max(c.max_rel_error for c in checks), tolerance=tolerance,
                         passed=all(c.passed for c in checks))


def per_sample(summed: dict[str, torch.Tensor], returned: dict[str, torch.Tensor], tolerance: float,
               how: str) -> QuantityCheck:
    return _tensors(how, summed, {n: g.detach().to(torch.float64) for n, g in returned.items()}, tolerance)


def hvp(params: dict[str, torch.Tensor], loss_fn: Callable[[], torch.Tensor], vector: dict[str, torch.Tensor],
        returned: dict[str, torch.Tensor], eps: float, tolerance: float) -> QuantityCheck:
    """(g(p + eps v) - g(p - eps v)) / 2 eps in float64, against the returned H v."""
    saved = {n: p.detach().clone() for n, p in params.items()}
    v = {n: vector[n].detach().to(p.device, torch.float64) for n, p in params.items()}
    grads = []
    for sign in (1.0, -1.0):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n]).add_(v[n], alpha=sign * eps)
        grads.append(torch.autograd.grad(loss_fn(), list(params.values()), materialize_grads=True))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
    fd = {n: (a - b) / (2 * eps) for n, a, b in zip(params, grads[0], grads[1])}
    return _tensors("central differences of float64 gradients along the vector, against H v",
                    {n: returned[n] for n in params}, fd, tolerance)


def input_gradient(loss_at: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, returned: torch.Tensor,
                   eps: float, tolerance: float, seed: int) -> QuantityCheck:
    """(L(x + eps u) - L(x - eps u)) / 2 eps in float64 along a random unit direction u of the input,
    against returned . u; an error under tolerance x sum |returned * u| (or the loss's rounding) passes."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)
    u /= max(float(u.norm()), 1e-300)
    with torch.no_grad():
        plus, minus = float(loss_at(x + eps * u)), float(loss_at(x - eps * u))
    fd = (plus - minus) / (2 * eps)
    g = returned.detach().to(x.device, torch.float64)
    ad = float((g * u).sum())
    abs_err = abs(fd - ad)
    rel = abs_err / max(abs(fd), abs(ad), 1e-12)
    atol = max(FLOOR_ROUNDINGS * F64_EPS * max(abs(plus), abs(minus), 1e-300) / eps, tolerance * float((g * u).abs().sum()))
    judged = verdict(max(abs(fd), abs(ad)), abs_err, rel, tolerance, atol,
                     FLOOR_ROUNDINGS * F64_EPS * max(abs(plus), abs(minus), 1e-300) / eps)
    return QuantityCheck(how="central differences of the float64 loss along a random direction of the input, "
                             "against input_gradient . direction", max_rel_error=0.0 if judged == "zero" else rel,
                         tolerance=tolerance, passed=judged != "failed")
