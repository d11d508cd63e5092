"""One numerical check's finite differences and returned-gradient check, as a `CheckRun` says.

Modes: `exact` perturbs every element (2P evaluations), `sampled` k random elements per tensor,
`directional` m random unit directions over all parameters (gradcheck's fast mode: 2m evaluations,
compared with grad . u). A tensor's error is max|fd - ad| / max(max|fd|, max|ad|, 1e-12).

`returned_check` (tolerances.py) judges the answer itself: the gradients exactly as returned (their dtype,
summed over micro-batches, checkpointed, accumulated over losses) against the float64 autograd reference on
the same batch, by the same ratio, in every mode (and along the directional mode's directions too).

With `batched` (batched.py: torch.func.vmap where the model is a pure function of its parameters;
reference.py decides), the perturbed losses of a tensor (or of a chunk of directions) are evaluated in one
call; `evaluations` still counts each of them. Any failure of a batched call falls back to the
one-at-a-time loop, which stays the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from gradsvc.wire import Numcheck, ParameterCheck

from .batched import Batched
from .directional import directional
from .exact import exact
from .tally import ProgressCallback, Tally
from .tolerances import ARITHMETIC_MAX, returned_check


@dataclass
class CheckRun:
    """What one check compares, and how. `grads` (float64 autograd) against finite differences of `loss_fn`
    over `params` (float64 leaves, perturbed in place and restored) in `mode` ("directional", "exact", or
    "sampled": `samples` of each tensor), step `eps`; a tensor (or direction) passes when its relative error
    is within `tolerance` or its absolute error is under the rounding floor. `returned` (the gradients the
    caller gets, in `returned_dtype`), when given, are judged against `grads` too, each tensor within its
    `returned_tolerances` entry (else the dtype's). `batched`: many perturbed losses a call (the same
    perturbed values, the same figures up to the batched kernels' rounding), `loss_fn` one at a time if a
    batched call fails. `seed` draws the sampled elements and the directions."""

    mode: str
    params: dict[str, torch.Tensor]
    loss_fn: Callable[[], torch.Tensor]
    grads: dict[str, torch.Tensor]
    eps: float
    tolerance: float
    samples: int
    directions: int
    seed: int
    progress: ProgressCallback | None = None
    returned: dict[str, torch.Tensor] | None = None
    returned_dtype: torch.dtype = torch.float64
    batched: Batched | None = None
    returned_tolerances: dict[str, float] = field(default_factory=dict)
    math_mode: str = "ieee"  # the float32 math `returned` was computed in (tolerances.returned_tolerance)


def run(check_run: CheckRun) -> Numcheck:
    """The check `check_run` describes; `passed` needs the finite differences and, with `returned`, the
    returned-gradient check."""
    c = check_run
    gen = torch.Generator().manual_seed(c.seed)
    tally = Tally(c.loss_fn, c.batched, c.eps, c.tolerance, c.progress)
    with torch.no_grad():
        if c.mode == "directional":
            per = {}
            along = directional(c.params, c.grads, tally, directions=c.directions, gen=gen, returned=c.returned)
        else:
            per = exact(c.params, c.grads, tally, samples=None if c.mode == "exact" else c.samples, gen=gen)
            along = []
    check = tally.summary(c.mode, per, c.grads)
    if c.returned is None:
        return check
    r = returned_check(c.returned, c.grads, c.returned_dtype, along, tolerances=c.returned_tolerances,
                       math_mode=c.math_mode)
    for name, rel in r.per_parameter.items():
        # Directional mode has no element-wise finite differences: those entries say checked=0.
        entry = per.setdefault(name, ParameterCheck(max_abs_error=0.0, max_rel_error=0.0, checked=0))
        entry.returned_max_rel_error, entry.returned_judged = rel, r.judged[name]
        entry.returned_tolerance = c.returned_tolerances.get(name, r.tolerance)
    check.returned_max_rel_error, check.returned_tolerance, check.returned_floor = r.max_rel_error, r.tolerance, r.floor
    check.passed = False if not r.passed else check.passed  # a returned gradient off fails, whatever the differences said
    say_unresolved(check, r.unresolved, c.returned_dtype)
    return check


def say_unresolved(check: Numcheck, unresolved: tuple[str, ...], dtype: torch.dtype) -> None:
    """A check that passed but for tensors its dtype's arithmetic does not resolve (`unresolved`): `passed`
    null, and a reason that names them and what judges them."""
    if not check.passed or not unresolved:
        return
    check.passed = None
    more = " and more" if len(unresolved) > 3 else ""
    said = (f"the returned gradients of {', '.join(unresolved[:3])}{more} were not judged: rounding every value at "
            f"{str(dtype).removeprefix('torch.')} moves their float64 gradient by more than the {ARITHMETIC_MAX:g} "
            "ceiling of a tolerance, so that arithmetic cannot tell them from a wrong gradient (passed is null; "
            "dtype float64 judges them)")
    check.reason = f"{check.reason}; {said}" if check.reason else said


def unchecked(dtype: torch.dtype) -> Numcheck:
    """What a result says when numcheck is "off": nothing was checked, so `passed` is null (neither passed nor
    failed), and no tolerance applied (both 0.0; `dtype`'s returned tolerance would read as a check that ran)."""
    return Numcheck(mode="off", eps=0.0, dtype="float64", evaluations=0, max_abs_error=0.0, max_rel_error=0.0,
                    passed=None, tolerance=0.0, per_parameter={}, returned_tolerance=0.0)
