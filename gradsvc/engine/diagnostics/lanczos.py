"""Lanczos iteration on a symmetric operator given by its products with vectors, in float64 with full
reorthogonalisation: the top eigenpairs (Ritz pairs) and stochastic Lanczos quadrature's nodes and weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Operator = Callable[[torch.Tensor], torch.Tensor]  # (P,) float64 -> (P,) float64


@dataclass
class Tridiagonal:
    """What m steps of Lanczos leave: the basis (m, P), the tridiagonal's diagonal and off-diagonal, and the
    last off-diagonal (beta_m, the size of the residual left outside the basis)."""

    basis: torch.Tensor
    alpha: list[float]
    beta: list[float]
    last_beta: float

    def ritz(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Ritz values (ascending) and the eigenvectors of the tridiagonal, (m,) and (m, m)."""
        m = len(self.alpha)
        t = torch.diag(torch.tensor(self.alpha, dtype=torch.float64))
        if m > 1:
            off = torch.tensor(self.beta, dtype=torch.float64)
            t += torch.diag(off, 1) + torch.diag(off, -1)
        return torch.linalg.eigh(t)


def lanczos(apply: Operator, start: torch.Tensor, steps: int,
            converged: Callable[[Tridiagonal], bool] | None = None) -> Tridiagonal:
    """Up to `steps` Lanczos steps from `start`, stopping early at an invariant subspace or when
    `converged` says so (asked every step: the tridiagonal's eigenproblem is tiny beside a product).
    The basis is one (steps, P) buffer filled row by row (krylov_bytes counts it before the queue); each step
    reads a view of its first rows, never a copy of the whole basis."""
    basis = torch.empty(steps, start.numel(), dtype=torch.float64)  # (steps, P)
    basis[0] = start / start.norm()
    alpha: list[float] = []
    beta: list[float] = []
    for j in range(steps):
        w = apply(basis[j])
        a = float(w @ basis[j])
        alpha.append(a)
        done = basis[:j + 1]  # (j + 1, P), a view
        w -= done.T @ (done @ w)
        w -= done.T @ (done @ w)  # twice is enough (Kahan): the basis stays orthogonal to rounding
        b = float(w.norm())
        state = Tridiagonal(done, alpha, beta, b)
        if b <= 1e-12 * max(abs(x) for x in alpha) or j == steps - 1:
            return state
        if converged is not None and converged(state):
            return state
        beta.append(b)
        torch.div(w, b, out=basis[j + 1])
    return Tridiagonal(basis, alpha, beta, 0.0)


# Lanczos steps per density probe (PyHessian's default is 100; 30 resolves the bulk and the outliers), and the
# cap on the top eigenvalues' Lanczos run, which stops earlier once the tolerance is met.
DEFAULT_DENSITY_STEPS = 30
DEFAULT_TOP_STEPS = 100


def top_steps(c, size: int) -> int:
    """Lanczos steps of options.curvature's top-eigenvalue run (`c` a CurvatureOptions) over `size` parameters."""
    return min(size, c.iterations or max(DEFAULT_TOP_STEPS, 10 * c.top))


def density_steps(c, size: int) -> int:
    """Lanczos steps of each density probe's run."""
    return min(size, c.iterations or DEFAULT_DENSITY_STEPS)


def krylov_vectors(c, size: int) -> int:
    """How many float64 vectors of the parameter count the curvature options hold at once: the top run's basis,
    its residual vector and the k eigenvectors; or one density probe's basis, its probe and residual (the probes
    run one after another). The trace alone holds none beyond a product's."""
    top = top_steps(c, size) + 1 + c.top if c.top else 0
    density = density_steps(c, size) + 2 if c.density else 0
    return max(top, density)


def krylov_bytes(c, size: int) -> int:
    return krylov_vectors(c, size) * size * 8


def top_ritz(apply: Operator, size: int, k: int, steps: int, tolerance: float,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The k largest Ritz values (largest first) and their vectors (k, P), with the steps taken; stops once
    each of the k has an error bound under tolerance x |theta|: the residual Lanczos knows without a product,
    r = |beta_m s_m|, or r^2 / gap (the Kato-Temple bound, gap to the nearest other Ritz value) where smaller."""

    def converged(state: Tridiagonal) -> bool:
        if len(state.alpha) <= k:
            return False
        values, vectors = state.ritz()
        top = torch.arange(len(values) - 1, len(values) - 1 - k, -1)
        resid = (state.last_beta * vectors[-1, top]).abs()
        others = (values[top, None] - values[None, :]).abs()  # (k, m)
        others[torch.arange(k), top] = torch.inf
        bound = torch.minimum(resid, resid ** 2 / others.min(dim=1).values.clamp_min(1e-300))
        return bool((bound <= tolerance * values[top].abs().clamp_min(1e-300)).all())

    start = torch.randn(size, generator=gen, dtype=torch.float64)
    state = lanczos(apply, start, steps, converged)
    values, vectors = state.ritz()
    order = torch.argsort(values, descending=True)[:k]
    return values[order], vectors[:, order].T @ state.basis, len(state.alpha)


def quadrature(state: Tridiagonal) -> tuple[list[float], list[float]]:
    """Stochastic Lanczos quadrature's nodes (Ritz values) and weights (first components squared) for one
    probe: the weights sum to 1 and sum(w theta) = q1^T M q1."""
    values, vectors = state.ritz()
    return values.tolist(), (vectors[0] ** 2).tolist()
