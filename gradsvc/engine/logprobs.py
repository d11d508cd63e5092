"""Log-probabilities of class targets, as a session's forward answers them (docs/sessions.md): per class-index
loss term (cross_entropy, nll: classes on dim 1, torch's convention) its per-element loss negated; with the
model's own loss, targets sent beside it are read against the first output shaped targets' shape + [classes]
(a language model's logits: classes last), with Hugging Face's ignored label -100 at 0, as cross_entropy's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import tensors
from .decode import as_tensor_value, dense_only
from .errors import SpecError
from .losses import LossTerm

IGNORED = -100  # cross_entropy's ignore_index, Hugging Face's label for a position without a target


def of_terms(terms: list[LossTerm], out: torch.Tensor, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{term: log-probability of each target} for the class-index terms (their targets integers)."""
    found = {}
    for term in terms:
        target = targets.get(term.name)
        if term.type in ("cross_entropy", "nll") and target is not None and not target.is_floating_point():
            fn = F.cross_entropy if term.type == "cross_entropy" else F.nll_loss
            found[term.name] = -fn(out, target, reduction="none")
    return found


def decode_labels(raw, max_elements: int) -> torch.Tensor:
    """The targets sent with the model's own loss: integer class indices."""
    labels = tensors.decode(dense_only(as_tensor_value(raw, "targets"), "targets"), where="targets",
                            max_elements=max_elements)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise SpecError("bad_target", f"targets with loss 'output' are class indices whose log-probabilities the "
                        f"forward answers; got {str(labels.dtype).removeprefix('torch.')}: send integers",
                        target_shape=list(labels.shape))
    return labels.to(torch.int64)


def of_labels(outputs: list, labels: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of the first floating output shaped labels' shape + [classes], at the labels."""
    shapes = [list(o.shape) for o in outputs if isinstance(o, torch.Tensor)]
    out = next((o for o in outputs if isinstance(o, torch.Tensor) and o.is_floating_point() and
                o.dim() == labels.dim() + 1 and o.shape[:-1] == labels.shape), None)
    if out is None:
        raise SpecError("bad_target", f"targets of shape {list(labels.shape)}: no output of the model is shaped "
                        f"{list(labels.shape)} + [classes] (its outputs: {shapes}); send targets shaped as its logits "
                        "without their last dim", target_shape=list(labels.shape), output_shapes=shapes)
    classes = out.shape[-1]
    kept = labels != IGNORED
    if labels.numel() and bool(((labels[kept] < 0) | (labels[kept] >= classes)).any()):
        raise SpecError("bad_target", f"targets must lie in [0, {classes - 1}] (or be {IGNORED}, a position without a "
                        f"target), got values in [{int(labels.min())}, {int(labels.max())}]", classes=classes)
    at = labels.to(out.device).where(kept.to(out.device), 0)
    picked = torch.log_softmax(out, dim=-1).gather(-1, at.unsqueeze(-1)).squeeze(-1)
    return picked.where(kept.to(out.device), torch.zeros((), dtype=picked.dtype, device=picked.device))
