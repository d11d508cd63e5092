"""Loss functions by name, and the checks that a target fits the model's output."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F

from . import tensors
from .errors import SpecError

# name -> (function, target kind): "class" takes integer class indices (or probabilities for
# cross_entropy), "same" a float tensor shaped like the output, "binary" the same in [0, 1].
LOSSES = MappingProxyType({
    "cross_entropy": (F.cross_entropy, "class"),
    "nll": (F.nll_loss, "class"),
    "mse": (F.mse_loss, "same"),
    "l1": (F.l1_loss, "same"),
    "smooth_l1": (F.smooth_l1_loss, "same"),
    "huber": (F.huber_loss, "same"),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, "binary"),
    "bce": (F.binary_cross_entropy, "binary"),
})
REDUCTIONS = ("mean", "sum")
# The model's own loss: its first output is the scalar to differentiate (a Hugging Face model given
# labels= returns .loss first; a forward may compute a contrastive or distillation loss itself).
OWN_LOSS = "output"


def loss_label(name: str) -> str:
    """How messages name a loss: "the loss" for a request's one `loss` (named "loss" by default), else by name."""
    return "the loss" if name == "loss" else f"loss {name!r}"


@dataclass(frozen=True)
class LossTerm:
    name: str
    type: str
    reduction: str
    weight: float
    target: str | None  # key in the targets object; None = the single targets tensor
    output: int | str | None = None  # the model's own loss: the output a request named ({"output": k})

    @property
    def label(self) -> str:
        return loss_label(self.name)

    def __call__(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        if self.type == OWN_LOSS:
            return output.reshape(())  # () : prepare checked it holds one element
        fn, _ = LOSSES[self.type]
        return fn(output, target, reduction=self.reduction)


def own_term(loss) -> LossTerm:
    """`loss: "output"` (or {"type": "output"}): the model's first output, as it computed it."""
    if isinstance(loss, str):
        return LossTerm("loss", OWN_LOSS, "mean", 1.0, None)
    if loss.type not in (None, OWN_LOSS):
        raise SpecError("bad_loss", f"loss: 'output' names one of the model's outputs as its own loss, which type "
                        f"{loss.type!r} does not take; give {{'output': ...}} alone, or a built-in type alone",
                        loss=loss.name or "loss", type=loss.type)
    if loss.reduction not in REDUCTIONS:
        raise SpecError("bad_loss", f"loss {OWN_LOSS!r}: reduction {loss.reduction!r} is not supported; the model's "
                        "own loss is used as it returns it, so leave 'reduction' out", loss=loss.name or "loss")
    term = make_term(loss.name or "loss", "mse", "mean", loss.weight, None)  # checks the weight
    return LossTerm(term.name, OWN_LOSS, "mean", term.weight, None, loss.output)


def make_term(name: str, type_: str, reduction: str, weight: float, target: str | None) -> LossTerm:
    if type_ == OWN_LOSS:
        raise SpecError("bad_loss", f"{loss_label(name)}: type {OWN_LOSS!r} (the model's own loss) takes the model's "
                        "whole first output, so it stands alone: give it as 'loss', not in 'losses'",
                        loss=name, type=type_)
    if type_ is None:
        raise SpecError("bad_loss", f"{loss_label(name)}: give its 'type' (one of {', '.join(LOSSES)}), or "
                        "{'output': k} alone in 'loss' for the model's own loss", loss=name)
    if type_ not in LOSSES:
        raise SpecError("bad_loss", f"{loss_label(name)}: unknown type {type_!r}; use one of {', '.join(LOSSES)}, or "
                        f"{OWN_LOSS!r} for the model's own loss (its first output)", loss=name, type=type_)
    if reduction not in REDUCTIONS:
        raise SpecError("bad_loss", f"{loss_label(name)}: reduction {reduction!r} is not supported; use 'mean' or 'sum'",
                        loss=name, reduction=reduction)
    if not isinstance(weight, (int, float)) or weight != weight or abs(weight) == float("inf"):
        raise SpecError("bad_loss", f"{loss_label(name)}: weight must be a finite number", loss=name)
    return LossTerm(name, type_, reduction, float(weight), target)


def prepare_target(term: LossTerm, output: torch.Tensor, target: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The target cast for `term`, after checking it fits `output` (which may live on meta)."""
    _, kind = LOSSES[term.type]
    out_shape, tgt_shape = list(output.shape), list(target.shape)
    where = f"targets for {term.label} ({term.type})"

    def fail(msg: str, **detail) -> None:
        raise SpecError("bad_target", f"{where}: {msg}", loss=term.name, target_shape=tgt_shape,
                        output_shape=out_shape, **detail)

    if kind == "class" and not target.dtype.is_floating_point:
        if target.dtype == torch.bool:
            fail("class indices must be integers, got bool")
        if output.dim() < 1:
            fail("the model's output must have a class dimension")
        want = ([out_shape[0]] + out_shape[2:]) if output.dim() >= 2 else []
        if tgt_shape != want:
            fail(f"expected class indices of shape {want} for output {out_shape}, got {tgt_shape}")
        classes = out_shape[1] if output.dim() >= 2 else out_shape[0]
        if target.numel() and not target.is_meta and (int(target.min()) < 0 or int(target.max()) >= classes):
            fail(f"class indices must lie in [0, {classes - 1}], got values in "
                 f"[{int(target.min())}, {int(target.max())}]", classes=classes)
        return target.to(torch.int64)
    if kind == "class":
        want = ([out_shape[0]] + out_shape[2:]) if output.dim() >= 2 else []
        if term.type == "nll" or (tgt_shape == want and tgt_shape != out_shape):
            got = str(target.dtype).removeprefix("torch.")
            # Shaped like class indices but floating: PyTorch would stop on "expected scalar type Long".
            fail(f"class indices must be integers, got {got} of shape {tgt_shape}; send them as "
                 "int64 (torch.long in Python, JSON integers written without a decimal point, or "
                 "{\"dtype\": \"int64\", ...})"
                 + ("" if term.type == "nll" else f", or class probabilities shaped like the output {out_shape}"),
                 expected_dtype="int64")
    if tgt_shape != out_shape:
        fail(f"expected shape {out_shape} (the model's output), got {tgt_shape}")
    if target.dtype == torch.bool or not (target.dtype.is_floating_point or target.dtype in (torch.int32, torch.int64, torch.uint8)):
        fail(f"expected numbers, got {target.dtype}")
    target = target.to(dtype)
    if target.is_meta:
        return target
    if kind == "binary" and target.numel() and (bool((target < 0).any()) or bool((target > 1).any())):
        fail("binary targets must lie in [0, 1]")
    if not tensors.all_finite(target):
        fail("targets must be finite")
    return target
