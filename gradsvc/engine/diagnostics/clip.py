"""Gradient clipping: global, exactly as torch.nn.utils.clip_grad_norm_ scales the gradients, and per
example, the DP-SGD step as Opacus takes it (clip each example's gradient, sum, add Gaussian noise, divide)."""

from __future__ import annotations

import torch

from gradsvc.wire import ClipOptions, ClipResult

# clip_grad_norm_'s own guard against a zero norm, kept so the factor is the one torch applies.
CLIP_EPS = 1e-6


def clip_global(grads: dict[str, torch.Tensor], max_norm: float) -> tuple[dict[str, torch.Tensor], ClipResult]:
    """The gradients scaled by min(1, max_norm / (total_norm + 1e-6)), the norm taken in their dtype."""
    total = torch.nn.utils.get_total_norm(list(grads.values()), 2.0)
    scale = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
    clipped = {n: g * scale.to(g.dtype) for n, g in grads.items()}
    return clipped, ClipResult(total_norm=float(total), scale=float(scale))


def clip_per_sample(per_example: dict[str, torch.Tensor], options: ClipOptions, reduction: str,
                    seed: int) -> tuple[dict[str, torch.Tensor], ClipResult]:
    """Opacus's step: each example's loss gradient scaled by min(1, C / (|g_n| + 1e-6)), summed, noise of
    standard deviation noise_multiplier x C added (from `seed`, on the CPU so every device draws the same),
    divided by N under a mean reduction (Opacus divides by the expected batch size only then)."""
    first = next(iter(per_example.values()))
    n = first.shape[0]
    flat_norms = torch.stack([g.reshape(n, -1).norm(dim=1) for g in per_example.values()])  # (params, batch)
    norms = torch.linalg.vector_norm(flat_norms, dim=0)  # (batch,)
    factors = (options.max_norm / (norms + CLIP_EPS)).clamp(max=1.0)  # (batch,)
    std = options.noise_multiplier * options.max_norm
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, g in per_example.items():
        summed = torch.einsum("n,n...->...", factors.to(g.dtype), g)
        if std > 0:
            noise = torch.normal(0.0, std, size=summed.shape, generator=gen, dtype=torch.float64)
            summed = summed + noise.to(summed.device, summed.dtype)
        out[name] = summed / n if reduction == "mean" else summed
    return out, ClipResult(clipped=int((norms > options.max_norm).sum()), examples=n, noise_std=std)
