"""options.diagnostics, options.clip and options.curvature in a result: norms, noise scale, clipping,
the spectrum."""

from __future__ import annotations

import msgspec
from msgspec import Struct

from gradsvc.wire.tensors import Tensor

# options.diagnostics names: what researchers compute from the gradients (docs/diagnostics.md).
DIAGNOSTICS = ("norms", "variance", "second_moment", "noise_scale")
# Of those, the ones made of per-example gradients (refused where the examples cannot be separated).
PER_EXAMPLE_DIAGNOSTICS = ("variance", "second_moment", "noise_scale")


class Norms(Struct):
    """L2 norms of the batch gradient before any clipping: the whole, each parameter's, each module's (the
    module path that owns the parameters: the layer index for a layer spec)."""

    global_: float = msgspec.field(name="global")
    parameters: dict[str, float] = {}
    modules: dict[str, float] = {}


class NoiseScale(Struct):
    """McCandlish et al. (2018): with g_n each example's loss gradient and g their mean over N,
    S = sum |g_n - g|^2 / (N - 1) (trace_covariance), |G|^2 = |g|^2 - S / N (gradient_norm_squared),
    b_simple = S / |G|^2; null with the `reason` when |G|^2 <= 0 or N < 2."""

    b_simple: float | None
    trace_covariance: float | None
    gradient_norm_squared: float | None
    reason: str = ""


class Diagnostics(Struct, omit_defaults=True):
    """One entry per name asked for in options.diagnostics. `variance` and `second_moment` are BackPACK's
    Variance and SumGradSquared for the request's loss reduction, per trainable parameter."""

    norms: Norms | None = None
    variance: dict[str, Tensor] | None = None
    second_moment: dict[str, Tensor] | None = None
    noise_scale: NoiseScale | None = None


class ClipResult(Struct, omit_defaults=True):
    """Global clipping: the pre-clip `total_norm` and the `scale` applied to every gradient. Per-sample:
    how many of the `examples` were `clipped`, and the noise's standard deviation (`noise_std`)."""

    total_norm: float | None = None
    scale: float | None = None
    clipped: int | None = None
    examples: int | None = None
    noise_std: float | None = None


class Density(Struct):
    """The stochastic Lanczos quadrature spectrum: Ritz values and their weights (summing to 1)."""

    eigenvalues: list[float]
    weights: list[float]


class Curvature(Struct, omit_defaults=True):
    """What options.curvature asked for. `residuals[i]` is |M v_i - lambda_i v_i| / |lambda_i| for the i-th
    top eigenpair (largest first); `products` counts the matrix-vector products computed; `trace_samples` are
    Hutchinson's per-probe values z^T M z, in probe order (their mean is `trace`)."""

    matrix: str
    top_eigenvalues: list[float] = []
    residuals: list[float] = []
    trace: float | None = None
    trace_stderr: float | None = None
    density: Density | None = None
    products: int = 0
    eigenvectors: list[dict[str, Tensor]] | None = None
    trace_samples: list[float] | None = None
