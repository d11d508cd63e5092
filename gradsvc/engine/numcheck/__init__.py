"""The numerical check of a prepared request (docs/numcheck.md): a float64 copy of the model on the same batch
and dropout masks, its autograd gradients as the reference (reference.py), auto's plan within the job's budget
(plan.py), finite differences (run.py: exact.py, directional.py, batched.py; kinks.py settles the offending
elements) and the returned-gradient check (tolerances.py), and each extra quantity checked its own way
(extras.py). `numerical_check` is the entry point."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gradsvc.wire import GradientRequest, Numcheck

from ..devices import one_cpu_thread
from ..errors import EngineError
from . import plan as planning
from .extras import quantity_checks
from .reference import Reference, computed_dtype
from .run import CheckRun, run, unchecked
from .tally import ProgressCallback
from .tolerances import returned_check

if TYPE_CHECKING:  # passes.py imports quantities.py, which imports tolerances.py from this package
    from ..config import EngineConfig
    from ..passes import Pass
    from ..prepared import Prepared

log = logging.getLogger("gradsvc.engine")

__all__ = ["CheckInputs", "ProgressCallback", "computed_dtype", "numerical_check", "returned_check"]


@dataclass
class CheckInputs:
    """What a job hands the check: the prepared request, the `returned` gradients as the caller gets them, and
    the pass (`final`) whose other quantities are checked too (`hvp_vector` the v of its H v, `per_sample_sum`
    its per-example gradients summed); `reference`, when given, receives the float64 autograd gradients."""

    prep: Prepared
    request: GradientRequest
    config: EngineConfig
    device: torch.device
    returned: dict[str, torch.Tensor]
    progress: ProgressCallback | None = None
    reference: dict[str, torch.Tensor] | None = None
    final: Pass | None = None
    hvp_vector: dict[str, torch.Tensor] | None = None
    per_sample_sum: dict[str, torch.Tensor] | None = None
    math_mode: str = "ieee"  # the float32 math the job's passes ran in: the returned gradients' tolerance follows it


def not_checkable(prep: Prepared) -> str:
    """Why the check cannot judge this model ("" when it can): finite differences here step real, dense
    elements, so a sparse or complex trainable parameter is not checked, and nothing is (`passed` null, this
    reason), rather than a verdict on part of the gradients."""
    frozen = set(prep.frozen)
    for name, p in prep.model.named_parameters():
        if name in frozen:
            continue
        if p.layout != torch.strided:
            return (f"not run: parameter {name!r} is {str(p.layout).removeprefix('torch.')}; finite differences "
                    "step dense real elements, so nothing was checked (passed is null)")
        if p.is_complex():
            return (f"not run: parameter {name!r} is complex; finite differences step real elements, so "
                    "nothing was checked (passed is null)")
    return ""


# What the check's own code raises when it cannot run on a model (an op without a float64 kernel, a second backward
# the model's graph cannot take, a tensor the reference cannot build, running out of memory): each ends the check,
# never the job. Anything else (a canceled job, RQ's timeout, a KeyboardInterrupt) is not the check's and goes on up.
_CHECK_FAILURES = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError, ArithmeticError,
                   NotImplementedError, AssertionError, MemoryError, EngineError)


def numerical_check(inputs: CheckInputs) -> Numcheck:
    """Finite differences against float64 autograd, and the returned gradients against that same float64
    autograd: full batch, no checkpointing, same dropout masks. What is checked (mode, elements, directions,
    step, tolerances) follows from the request alone, never from a timing.

    The check never takes a job down: whatever fails inside it, the job answers its gradients with a check that
    says it did not run (`passed` null) and why, in `reason`."""
    try:
        return _check(inputs)
    except _CHECK_FAILURES as exc:
        log.warning("the numerical check could not run (the job answers its gradients unchecked)", exc_info=True)
        check = unchecked(inputs.prep.dtype)
        said = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "no message"
        check.reason = (f"not run: the numerical check failed inside ({type(exc).__name__}: {said}), so nothing was "
                        "checked (passed is null); the gradients are autograd's, computed as without the check")
        return check


def _check(inputs: CheckInputs) -> Numcheck:
    prep, device = inputs.prep, inputs.device
    opts = prep.options
    if opts.numcheck == "off":
        return unchecked(prep.dtype)
    skipped = not_checkable(prep)
    if skipped:
        check = unchecked(prep.dtype)
        check.reason = skipped
        return check
    ref = Reference(prep, inputs.request, device, inputs.math_mode)
    if inputs.reference is not None:
        inputs.reference.update({n: g.detach().to("cpu") for n, g in ref.grads.items()})
    plan = planning.plan_for(opts, inputs.config, ref.work, [p.numel() for p in ref.params.values()])
    dtype = computed_dtype(prep)
    with one_cpu_thread(device, planning.nominal_eval_s(ref.work) <= planning.SMALL_EVAL_S):
        check = run(CheckRun(plan.mode, ref.params, ref.loss_fn, ref.grads, eps=opts.numcheck_eps,
                             tolerance=opts.numcheck_tolerance, samples=plan.samples, directions=plan.directions,
                             seed=ref.seed, progress=inputs.progress, returned=inputs.returned, returned_dtype=dtype,
                             batched=ref.batched(prep), returned_tolerances=ref.returned_tolerances(dtype),
                             math_mode=inputs.math_mode))
        if inputs.final is not None:
            check.quantities = quantity_checks(ref, inputs.final, inputs.hvp_vector, inputs.per_sample_sum)
            check.passed = check.passed and all(q.passed for q in check.quantities.values())
    check.reason = f"{plan.reason}; {check.reason}" if check.reason else plan.reason
    check.budget_evaluations, check.cut, check.held = plan.budget, plan.cut, ref.held()
    return check
