"""The `exact` and `sampled` modes: central differences element by element (every element of each tensor, or
a seeded sample of each), batched where the model allows it, each tensor judged, offending elements settled
(kinks.py)."""

from __future__ import annotations

import torch

from gradsvc.wire import ParameterCheck

from . import tolerances
from .batched import _perturbed, _plan
from .kinks import settle
from .tally import Tally


def exact(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], tally: Tally, *, samples: int | None,
          gen: torch.Generator) -> dict[str, ParameterCheck]:
    """Central differences element by element: every element of each tensor, or (`samples`) that many
    random ones of each larger tensor, against autograd's; each tensor judged into `tally`."""
    picks = {}
    for name, p in params.items():
        if samples is None or p.numel() <= samples:
            picks[name] = torch.arange(p.numel())
        else:
            picks[name] = torch.randperm(p.numel(), generator=gen)[:samples].sort().values
    sides = _batched_differences(params, picks, tally) if tally.batched is not None else {}
    total = 2 * sum(len(ix) for ix in picks.values())
    done = tally.evaluations  # a tensor a failed call left unfinished is redone below, one loss at a time
    per: dict[str, ParameterCheck] = {}
    checked: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # name -> (plus, minus, ad)
    for name, p in params.items():
        flat = p.view(-1)
        idx = picks[name]
        if name not in sides:
            plus, minus = torch.empty(len(idx), dtype=torch.float64), torch.empty(len(idx), dtype=torch.float64)
            for j, i in enumerate(idx.tolist()):
                plus[j], minus[j] = _element_losses(flat, i, tally.eps, tally)
                done += 2
                if done % 64 == 0:
                    tally.report(done, total)
            sides[name] = (plus, minus)
        checked[name] = (*sides[name], grads[name].detach().reshape(-1)[idx].to("cpu", torch.float64))
    scale = max((float(ad.abs().max()) for _, _, ad in checked.values() if ad.numel()), default=0.0)
    for name, (plus, minus, ad) in checked.items():
        per[name] = _judge_tensor(params[name].view(-1), picks[name], plus, minus, ad, scale, tally)
    return per


def _element_losses(flat: torch.Tensor, i: int, step: float, tally: Tally) -> tuple[float, float]:
    """The losses with element `i` of `flat` at orig + step and at orig - step; the element restored."""
    orig = float(flat[i])
    flat[i] = orig + step
    plus = tally.loss_at()
    flat[i] = orig - step
    minus = tally.loss_at()
    flat[i] = orig
    return plus, minus


def _judge_tensor(flat: torch.Tensor, idx: torch.Tensor, plus: torch.Tensor, minus: torch.Tensor, ad: torch.Tensor,
                  scale: float, tally: Tally) -> ParameterCheck:
    """One tensor's verdict from its elements' losses at +-eps. gradcheck's rule element by element,
    |fd - ad| <= atol + tolerance |ad|, with atol what float64 and the step resolve for this loss, or the
    tolerance x the model's largest gradient element. A tensor that would fail has its offending elements
    settled (`_settle`): re-differenced at smaller steps, or found straddling a kink and left out."""
    tolerance, eps = tally.tolerance, tally.eps
    fd = (plus - minus) / (2 * eps)
    loss_scale = float(torch.maximum(plus.abs(), minus.abs()).max()) if len(plus) else 0.0
    atol = max(tally.rounding(loss_scale), tolerance * scale)
    kept = torch.ones(len(ad), dtype=torch.bool)
    verdict, abs_err, rel = _tensor_verdict(fd, ad, kept, atol, tally.rounding(loss_scale), tolerance)
    kinks = unsettled = 0
    if verdict == "failed":
        allowed = max(atol, tolerance * float(ad.abs().max()))
        for j in ((fd - ad).abs() > allowed).nonzero().flatten().tolist():
            outcome, value = settle(lambda step, i=int(idx[j]): _element_losses(flat, i, step, tally),
                                     float(ad[j]), float(plus[j]), float(minus[j]), allowed, tally)
            fd[j] = value
            kept[j] = outcome in ("resolved", "failed")  # a kink or an unsettled difference is left out
            unsettled += outcome == "unsettled"
        kinks = int((~kept).sum()) - unsettled
        verdict, abs_err, rel = _tensor_verdict(fd, ad, kept, atol, tally.rounding(loss_scale), tolerance)
        if verdict == "kink" and not kinks:
            verdict = "unsettled"
    tally.kinks += kinks
    tally.unsettled += unsettled
    if verdict not in ("kink", "unsettled"):
        tally.judge(abs_err, rel, atol, verdict)
    return ParameterCheck(max_abs_error=abs_err, max_rel_error=rel, checked=len(ad), judged=verdict, kinks=kinks)


def _tensor_verdict(fd: torch.Tensor, ad: torch.Tensor, kept: torch.Tensor, atol: float, zero: float,
                    tolerance: float) -> tuple[str, float, float]:
    """(verdict, max abs error, relative error) over the `kept` elements; "kink" where none is kept."""
    if not len(ad):
        return "zero", 0.0, 0.0
    if not bool(kept.any()):
        return "kink", 0.0, 0.0
    fd, ad = fd[kept], ad[kept]
    abs_err = float((fd - ad).abs().max())
    rel = tolerances.rel(abs_err, fd, ad)
    size = max(float(fd.abs().max()), float(ad.abs().max()))
    verdict = tolerances.verdict(size, abs_err, rel, tolerance, atol, zero)
    if verdict == "failed" and bool(((fd - ad).abs() <= atol + tolerance * ad.abs()).all()):
        verdict = "floor"
    return verdict, abs_err, rel


def _batched_differences(params: dict[str, torch.Tensor], picks: dict[str, torch.Tensor],
                         tally: Tally) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (the picked elements' losses at +eps, at -eps) for every tensor whose batched calls all
    succeeded (counted into the tally's evaluations); the others are left to exact's loop."""
    filled: dict[str, int] = {}  # name -> elements whose differences are in
    pluses = {name: torch.empty(len(ix), dtype=torch.float64) for name, ix in picks.items()}
    minuses = {name: torch.empty(len(ix), dtype=torch.float64) for name, ix in picks.items()}
    total = 2 * sum(len(ix) for ix in picks.values())
    done = 0
    for call in _plan(params, picks, tally.batched):
        losses = tally.losses_at(_perturbed(params, picks, call, tally.eps))
        if losses is None:
            break
        half = len(losses) // 2  # rows: every element at orig + eps, then each at orig - eps
        row = 0
        for name, start, stop in call:
            k = stop - start
            pluses[name][start:stop] = losses[row:row + k]
            minuses[name][start:stop] = losses[half + row:half + row + k]
            filled[name] = filled.get(name, 0) + k
            row += k
        if (done + 2 * half) // 64 > done // 64:
            tally.report(done + 2 * half, total)
        done += 2 * half
    sides = {name: (pluses[name], minuses[name]) for name, ix in picks.items()
             if len(ix) and filled.get(name) == len(ix)}
    tally.evaluations += sum(2 * len(picks[name]) for name in sides)
    return sides
