"""What researchers compute from gradients, computed beside them: norms (norms.py), the examples' gradient
statistics (norms.py: BackPACK's Variance and SumGradSquared, the gradient noise scale), clipping (clip.py:
clip_grad_norm_'s and Opacus's DP-SGD step) and curvature (curvature.py over lanczos.py). compute() runs
`run` once, after the batch's gradient and the examples' gradients exist; the check judges the gradient
before clipping, and the clipped gradients are what the caller gets (`Outcome.returned`)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from gradsvc.wire import PER_EXAMPLE_DIAGNOSTICS, ClipResult, Curvature, Diagnostics, GradientResult, Options

from ..errors import ComputeError
from ..tensors import all_finite
from . import clip as clipping
from . import norms as stats
from .curvature import curvature


def wants_examples(opts: Options) -> bool:
    """Whether the options need each example's own gradient."""
    return any(d in PER_EXAMPLE_DIAGNOSTICS for d in opts.diagnostics) or bool(opts.clip and opts.clip.per_sample)


@dataclass
class Outcome:
    diagnostics: Diagnostics | None = None
    clip: ClipResult | None = None
    curvature: Curvature | None = None
    clipped: dict[str, torch.Tensor] | None = None  # the gradients to return instead of the batch's

    def returned(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradients the caller gets: clipped when clipping was asked for, in the returned dtype."""
        if self.clipped is None:
            return grads
        out = {n: self.clipped[n].to(g.dtype) for n, g in grads.items()}
        for name, g in out.items():
            if not all_finite(g):
                noise = f" (noise of std {self.clip.noise_std:g})" if self.clip.noise_std else ""
                raise ComputeError("non_finite", f"the gradient of {name!r} after options.clip{noise} holds values "
                                   f"{g.dtype} cannot hold (infinite or NaN); lower options.clip.noise_multiplier "
                                   "or max_norm, or use a wider model.dtype", parameter=name,
                                   dtype=str(g.dtype).removeprefix("torch."))
        return out

    def into(self, result: GradientResult) -> GradientResult:
        return msgspec.structs.replace(result, diagnostics=self.diagnostics, clip=self.clip, curvature=self.curvature)


def run(prep, params: dict[str, torch.Tensor], device: torch.device, seed: int, grads: dict[str, torch.Tensor],
        per_example: dict[str, torch.Tensor] | None, progress=None) -> Outcome:
    """Every diagnostic the options ask for, from the batch's gradient `grads` (as computed, before any
    clipping) and the examples' own loss gradients `per_example` ({name: (batch, *shape)}, when needed)."""
    opts = prep.options
    out = Outcome()
    reduction = prep.terms[0].reduction
    if opts.diagnostics:
        wanted = set(opts.diagnostics)
        out.diagnostics = Diagnostics(
            norms=stats.norms(grads) if "norms" in wanted else None,
            variance=stats.encoded(stats.variance(per_example, reduction), prep.dtype) if "variance" in wanted else None,
            second_moment=(stats.encoded(stats.second_moment(per_example, reduction), prep.dtype)
                           if "second_moment" in wanted else None),
            noise_scale=stats.noise_scale(per_example) if "noise_scale" in wanted else None)
    if opts.clip is not None and opts.clip.per_sample:
        out.clipped, out.clip = clipping.clip_per_sample(per_example, opts.clip, reduction, seed)
    elif opts.clip is not None:
        out.clipped, out.clip = clipping.clip_global(grads, opts.clip.max_norm)
    if opts.curvature is not None:
        out.curvature = curvature(prep, params, device, seed, progress)
    return out
