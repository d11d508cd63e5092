"""The `directional` mode (gradcheck's fast mode): random-sign unit directions over all parameters, the
central difference along each against grad . u, batched where the model allows it, offending directions
settled (kinks.py)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import tolerances
from .kinks import settle
from .tally import Tally


def directional(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], tally: Tally, *, directions: int,
                gen: torch.Generator, returned: dict[str, torch.Tensor] | None) -> list[tuple[float, float, float]]:
    """gradcheck's fast mode: `directions` random unit directions u over all parameters, (L(p + eps u) -
    L(p - eps u)) / 2 eps against grad . u, each direction judged into `tally`. Returns, per direction,
    (returned . u, grad . u, sum |grad * u|) for the returned-gradient check (empty without `returned`)."""
    eps = tally.eps
    along: list[tuple[float, float, float]] = []
    total = 2 * directions
    count = sum(p.numel() for p in params.values())
    scale = 1.0 / math.sqrt(max(count, 1))
    # sum |reference * u| (|u| is `scale` everywhere): the size of grad . u's terms, which sets what
    # an error along u is measured against when the terms cancel.
    terms = scale * sum(float(grads[n].abs().sum()) for n in params)
    if returned is not None:  # one float64 copy
        returned64 = {n: returned[n].detach().to(p.device, torch.float64).reshape(-1) for n, p in params.items()}
    saved = {name: p.detach().clone() for name, p in params.items()}
    # Directions a batched call takes at once (each two evaluations over every parameter); 1: no batching.
    step = max(1, tally.batched.rows(count) // 2) if tally.batched is not None else 1
    for first in range(0, directions, step):
        chunk = []
        for _ in range(first, min(first + step, directions)):
            # Random signs over all parameters: a unit direction whose norm is known exactly, and
            # ~7x cheaper to draw than a Gaussian one at a million parameters.
            chunk.append({name: (torch.randint(0, 2, p.shape, generator=gen, dtype=torch.int8)
                                 .to(p.device, torch.float64).mul_(2).sub_(1).mul_(scale))
                          for name, p in params.items()})
        losses = None
        if tally.batched is not None and step > 1:
            # Rows: p + eps u for each direction, then p - eps u for each; p itself is never written.
            losses = tally.losses_at({name: torch.stack([torch.add(p, us[name], alpha=sign * eps)
                                                         for sign in (1, -1) for us in chunk])
                                      for name, p in params.items()})
            if losses is not None:
                tally.evaluations += 2 * len(chunk)
        for j, us in enumerate(chunk):
            k = first + j
            if losses is not None:
                plus, minus = float(losses[j]), float(losses[len(chunk) + j])
            else:  # p + eps u, then p - eps u (the batched rows' values), then p exactly as it was
                plus, minus = _direction_losses(params, saved, us, eps, tally)
            ad = sum(float((grads[name] * us[name]).sum()) for name in params)
            if returned is not None:
                along.append((sum(float(torch.dot(returned64[n], us[n].reshape(-1))) for n in params), ad, terms))
            _judge_direction(lambda step, u=us: _direction_losses(params, saved, u, step, tally), ad, plus, minus,
                             terms, tally)
            tally.report(2 * (k + 1), total)
    return along


def _judge_direction(losses_at: Callable[[float], tuple[float, float]], ad: float, plus: float, minus: float,
                     terms: float, tally: Tally) -> None:
    """One direction judged into `tally` (within the tolerance, or under atol: the rounding floor or the
    tolerance x its terms), settled as exact settles an element where it would fail."""
    tolerance = tally.tolerance
    fd = (plus - minus) / (2 * tally.eps)
    floor = tally.rounding(max(abs(plus), abs(minus)))
    atol = max(floor, tolerance * terms)
    err = abs(fd - ad)
    verdict = tolerances.verdict(max(abs(fd), abs(ad)), err, err / max(abs(fd), abs(ad), 1e-12), tolerance, atol,
                                 floor)
    if verdict == "failed":
        outcome, fd = settle(losses_at, ad, plus, minus, max(atol, tolerance * abs(ad)), tally, several=True)
        if outcome == "kink":
            tally.kinks += 1
            return
        if outcome == "unsettled":
            tally.unsettled += 1
            return
        verdict = "ratio" if outcome == "resolved" else "failed"
    abs_err = abs(fd - ad)
    tally.judge(abs_err, abs_err / max(abs(fd), abs(ad), 1e-12), atol, verdict)


def _direction_losses(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], u: dict[str, torch.Tensor],
                      step: float, tally: Tally) -> tuple[float, float]:
    """The losses at p + step u and p - step u; p restored from `saved`."""
    for name, p in params.items():
        p.copy_(saved[name]).add_(u[name], alpha=step)
    plus = tally.loss_at()
    for name, p in params.items():
        p.copy_(saved[name]).add_(u[name], alpha=-step)
    minus = tally.loss_at()
    for name, p in params.items():
        p.copy_(saved[name])
    return plus, minus
