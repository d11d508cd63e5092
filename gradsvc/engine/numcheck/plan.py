"""The numerical check's plan: what one float64 evaluation of the loss does (`Work`), what it takes on a nominal
machine, the budget in evaluations, and `auto`'s choice of mode within it (docs/numcheck.md, "One request, one
verdict"). Everything here follows from the request alone, never from a timing."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from gradsvc.wire import Options

    from ..config import EngineConfig


class Plan(NamedTuple):
    """What `auto` chose: the mode, its samples or directions, why, and what the budget cut ("" if nothing)."""

    mode: str
    samples: int
    directions: int
    reason: str
    budget: int = 0
    cut: str = ""
    evaluations: int = 0  # what auto planned (a kink's settling adds to what the check counts)


class Work(NamedTuple):
    """What one float64 evaluation of the loss does, counted on the request's own forward: the ops (modules
    or graph nodes) it runs, the elements they output, and the floating-point operations of its matmuls,
    convolutions and attention (torch's FlopCounterMode)."""

    ops: int
    elements: int
    flops: int = 0


# A nominal machine's cost of an evaluation, to turn the budget's seconds into evaluations: per evaluation (the
# loss's call, its dropout masks, restoring written buffers), per op (Python and dispatch), per output element
# and per flop (float64 arithmetic). Fixed numbers, so that the plan is the same on any machine under any load;
# a slower machine takes longer for the same check, it never checks less. Calibrated in CPU time on one thread
# (bench/numcheck_calibrate.py, docs/performance.md): a relative least-squares fit over the zoo, scaled by 2.25
# so that no model's evaluation took more CPU time than its nominal one.
NOMINAL_EVAL_S = 70e-6
NOMINAL_OP_S = 11e-6
NOMINAL_ELEMENT_S = 15e-9
NOMINAL_FLOP_S = 32e-12

# The job's forward+backward, in float64 evaluations: a backward costs about two forwards, and the job runs
# in the request's dtype (float32 about twice float64's speed on a CPU).
JOB_EVALUATIONS = 1.5


def nominal_eval_s(work: Work) -> float:
    """What one evaluation takes on the nominal machine."""
    return (NOMINAL_EVAL_S + work.ops * NOMINAL_OP_S + work.elements * NOMINAL_ELEMENT_S
            + work.flops * NOMINAL_FLOP_S)


def budget_evaluations(work: Work, budget: float, budget_min_s: float) -> int:
    """The evaluations `budget` x the job's forward+backward + `budget_min_s` buy on the nominal machine."""
    return int(budget * JOB_EVALUATIONS + budget_min_s / max(nominal_eval_s(work), 1e-9))


def plan_auto(sizes: list[int], fits: int, *, exact_max: int, samples: int, directions: int) -> Plan:
    """The most thorough mode whose evaluations fit `fits` (budget_evaluations): exact (2 per element, up
    to `exact_max` elements), sampled (2 per sampled element, `samples` per tensor, cut down to fit while
    at least 2 per tensor do), else directional (2 per direction, cut down to fit, at least 2). Only what
    is checked shrinks with the budget: a seeded subset of the same elements or directions."""
    count, tensors = sum(sizes), len(sizes)
    budget = f"a budget of {fits} evaluations"

    def sampled_cost(k: int) -> int:
        return 2 * sum(min(n, k) for n in sizes)

    if count <= exact_max and 2 * count <= fits:
        return Plan("exact", samples, directions, f"exact: {2 * count} evaluations within {budget}", fits,
                    evaluations=2 * count)
    k = samples
    while k > 2 and sampled_cost(k) > fits:
        k -= 1
    if sampled_cost(k) <= fits and sampled_cost(k) < 2 * count:
        cut = "" if k == samples else (f"samples per tensor cut from {samples} to {k}: {sampled_cost(samples)} "
                                       f"evaluations would exceed {budget}")
        return Plan("sampled", k, directions, f"sampled: up to {k} elements of each of {tensors} tensors, "
                    f"{sampled_cost(k)} evaluations within {budget} (exact would take {2 * count})", fits, cut,
                    sampled_cost(k))
    d = min(directions, max(2, fits // 2))
    cut = "" if d == directions else (f"directions cut from {directions} to {d}: {2 * directions} evaluations "
                                      f"would exceed {budget}")
    return Plan("directional", samples, d, f"directional: {d} directions, {2 * d} evaluations within {budget} "
                f"(sampled would take {sampled_cost(2)}, exact {2 * count})", fits, cut, 2 * d)


# An evaluation this small (on the nominal machine) runs on one thread: with the cores busy, an intra-op
# team's wake-ups cost more than its ops, and the check is tens to hundreds of such evaluations. The MNIST
# example's CNN (6.1 ms nominal): 2.4 ms of CPU on one thread, 150 ms of wall time on two with the load
# average at 10 on 2 cores (a ResNet block: 0.2 ms on one, 2-40 ms on two). The kernels are the same.
SMALL_EVAL_S = 10e-3


def plan_for(options: Options, config: EngineConfig, work: Work, sizes: list[int]) -> Plan:
    """A request's plan: the mode its `options` name, or auto's choice within the budget's evaluations for an
    evaluation doing `work` over trainable tensors of `sizes` elements."""
    samples = options.numcheck_samples or config.numcheck_samples
    fits = budget_evaluations(work, config.numcheck_budget, config.numcheck_budget_min_s)
    if options.numcheck != "auto":
        return Plan(options.numcheck, samples, config.numcheck_directions,
                    f"{options.numcheck}: asked for by options.numcheck")
    plan = plan_auto(sizes, fits, exact_max=config.numcheck_exact_max, samples=samples,
                     directions=config.numcheck_directions)
    why = (f"auto chose {plan.reason}, {config.numcheck_budget:g} x the job's forward+backward + "
           f"{config.numcheck_budget_min_s:g} s on a nominal machine (an evaluation: {work.ops} ops, "
           f"{work.elements} output elements, {work.flops} flops)")
    return plan._replace(reason=why)
