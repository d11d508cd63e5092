"""The numerical check of a prepared request: a float64 copy of the model on the same batch and dropout
masks, its autograd gradients as the reference, auto's plan within the job's budget, then numcheck.py's
finite differences and returned-gradient check, and each extra quantity checked its own way."""

from __future__ import annotations

import copy
import math
import time

import torch

from gradsvc.wire import GradientRequest

from . import numcheck, numcheck_batched, quantities, tensors
from .batch import Batch
from .config import EngineConfig
from .devices import is_random, seeded
from .numcheck import ProgressCallback
from .passes import Pass
from .prepared import Prepared
from .program import FloatDType


def numerical_check(prep: Prepared, request: GradientRequest, config: EngineConfig, device: torch.device,
                    progress: ProgressCallback | None, returned: dict[str, torch.Tensor],
                    reference: dict[str, torch.Tensor] | None = None, job_s: float = 0.0, final: Pass | None = None,
                    hvp_vector: dict[str, torch.Tensor] | None = None,
                    per_sample_sum: dict[str, torch.Tensor] | None = None):
    """Finite differences against float64 autograd, and `returned` (the gradients as the caller gets
    them) against that same float64 autograd: full batch, no checkpointing, same dropout masks."""
    opts = prep.options
    trainable = [n for n, _ in prep.model.named_parameters() if n not in prep.frozen]
    mode = opts.numcheck
    if mode == "off":
        return numcheck.unchecked(prep.dtype)
    started = time.perf_counter()
    model64 = copy.deepcopy(prep.model).to(torch.float64)
    if prep.graph is not None:
        model64.upcast_all = True  # a float64 function of the parameters, whatever casts the model makes
    x64 = prep.inputs.map(lambda x, _: x.to(torch.float64) if x.is_floating_point() else x)
    t64 = {k: (v.to(torch.float64) if v.dtype.is_floating_point else v) for k, v in prep.targets.items()}
    params = {n: p for n, p in model64.named_parameters() if n in trainable}
    for n, p in model64.named_parameters():
        p.requires_grad_(n in params)
    seed = request.model.seed

    random = is_random(model64)
    batchable = numcheck_batched.batchable(model64, device, graph=prep.graph is not None, random=random)

    def loss_fn() -> torch.Tensor:
        with seeded(seed, device, random):
            out = model64(*x64.tensors)
            return sum(t.weight * t(out, t64.get(t.name)) for t in prep.terms)

    with numcheck_batched.output_elements(model64, on=batchable and prep.graph is None) as activations:
        loss = loss_fn()
    eval_s = math.inf
    if mode == "auto":  # the cost of one float64 evaluation, as the check runs them (no grad), after a warm-up
        with torch.no_grad():
            for _ in range(2):
                t0 = time.perf_counter()
                loss_fn()
                eval_s = min(eval_s, time.perf_counter() - t0)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()), materialize_grads=True)))
    if reference is not None:
        reference.update({n: g.detach().to("cpu") for n, g in grads.items()})
    samples = opts.numcheck_samples or config.numcheck_samples
    directions = config.numcheck_directions
    batched = None
    if batchable:
        rows = numcheck_batched.graph_output_elements(model64, x64.tensors) if prep.graph is not None else activations[0]
        batched = numcheck_batched.batched(model64, x64.tensors, t64, prep.terms, rows)
    if mode == "auto":
        if batched is not None:  # evaluations many to a call cost less each: measure one call
            eval_s = min(eval_s, numcheck_batched.batched_eval_s(batched, params))
        budget_s = config.numcheck_budget * job_s + config.numcheck_budget_min_s
        # What is left of the budget after the float64 copy and reference, at a margin over the measured cost
        # of an evaluation: the loop's own work (perturbing, the batched calls' copies) and a loaded machine.
        left_s = budget_s - (time.perf_counter() - started)
        plan = numcheck.plan_auto([p.numel() for p in params.values()], EVAL_MARGIN * eval_s, left_s,
                                  exact_max=config.numcheck_exact_max,
                                  samples=samples, directions=directions)
        mode, samples, directions, reason = plan
        reason = f"auto chose {reason}: within {config.numcheck_budget:g} x the job's forward+backward " \
                 f"({job_s * 1e3:.3g} ms) + {config.numcheck_budget_min_s:g} s"
    else:
        reason = f"{mode}: asked for by options.numcheck"
    check = numcheck.run(mode, params, loss_fn, grads, eps=opts.numcheck_eps, tolerance=opts.numcheck_tolerance,
                         samples=samples, directions=directions, seed=seed, progress=progress,
                         returned=returned, returned_dtype=computed_dtype(prep), batched=batched)
    check.reason = f"{reason}; {check.reason}" if check.reason else reason
    if final is not None:
        check.quantities = _quantity_checks(prep, final, params, loss_fn, model64, x64, t64, hvp_vector,
                                            per_sample_sum, seed, device)
        check.passed = check.passed and all(q.passed for q in check.quantities.values())
    return check


EVAL_MARGIN = 1.5


def _quantity_checks(prep: Prepared, final: Pass, params: dict[str, torch.Tensor], loss_fn, model64, x64: Batch,
                     t64: dict[str, torch.Tensor], hvp_vector: dict[str, torch.Tensor] | None,
                     per_sample_sum: dict[str, torch.Tensor] | None, seed: int, device: torch.device) -> dict:
    """Each returned quantity besides the gradients, checked its own way (quantities.py)."""
    opts = prep.options
    exact = numcheck.returned_tolerance(computed_dtype(prep))  # identities: the returned dtype's tolerance
    by_differences = max(exact, opts.numcheck_tolerance)  # differences in float64 resolve no better than this
    out = {}
    returned = {n: g for n, g in final.grads.items() if n in params}
    if final.per_loss:
        with seeded(seed, device, is_random(model64)):
            out_ = model64(*x64.tensors)
            losses = [t(out_, t64.get(t.name)) for t in prep.terms]
        reference = {}
        for k, (term, value) in enumerate(zip(prep.terms, losses)):
            grads = torch.autograd.grad(value, list(params.values()), retain_graph=k < len(losses) - 1,
                                        materialize_grads=True)
            reference[term.name] = dict(zip(params, grads))
        out["per_loss"] = quantities.per_loss({t: {n: g[n] for n in returned} for t, g in final.per_loss.items()},
                                              reference, exact)
    if per_sample_sum is not None and returned and len({t.reduction for t in prep.terms}) == 1:
        how = ("the per-example gradients " + ("averaged" if prep.terms[0].reduction == "mean" else "summed") +
               ", against the returned gradients")
        out["per_sample"] = quantities.per_sample({n: per_sample_sum[n] for n in returned}, returned,
                                                  exact,
                                                  how)
    if hvp_vector is not None and final.hvp:
        out["hvp"] = quantities.hvp(params, loss_fn, hvp_vector, final.hvp, opts.numcheck_eps, by_differences)
    if opts.input_grad and final.input_grad:
        i = x64.floating()[0]

        def loss_at(x: torch.Tensor) -> torch.Tensor:
            xs = list(x64.tensors)
            xs[i] = x
            with seeded(seed, device, is_random(model64)):
                out_ = model64(*xs)
                return sum(t.weight * t(out_, t64.get(t.name)) for t in prep.terms)

        out["input_gradient"] = quantities.input_gradient(loss_at, x64.tensors[i], torch.cat(final.input_grad),
                                                          opts.numcheck_eps, by_differences, seed)
    return out


def computed_dtype(prep: Prepared) -> torch.dtype:
    """The least precise float dtype the returned gradients went through: the model's, or for a graph
    run as captured, a lower one its own casts name (HF Llama's float32 RMSNorm in a float64 model), or
    options.gradient_dtype where that is less precise."""
    computed = _model_computed_dtype(prep)
    asked = prep.options.gradient_dtype
    if asked is not None and torch.finfo(tensors.TORCH_DTYPES[asked]).eps > torch.finfo(computed).eps:
        return tensors.TORCH_DTYPES[asked]
    return computed


def _model_computed_dtype(prep: Prepared) -> torch.dtype:
    if prep.graph is None or prep.dtype != prep.graph.compiled.dtype:
        return prep.dtype  # a graph run in another dtype than captured maps its casts to that dtype
    def casts(a):
        if isinstance(a, FloatDType):
            yield a.dtype
        elif isinstance(a, (list, tuple)):
            for x in a:
                yield from casts(x)

    named = {d for step in prep.graph.compiled.steps for a in (*step.args, *step.kwargs.values()) for d in casts(a)}
    return max(named | {prep.dtype}, key=lambda d: torch.finfo(d).eps)  # the largest epsilon
