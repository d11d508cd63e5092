"""The numerical check of a prepared request: a float64 copy of the model on the same batch and dropout
masks, its autograd gradients as the reference, auto's plan within the job's budget, then numcheck.py's
finite differences and returned-gradient check, and each extra quantity checked its own way."""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from gradsvc.wire import GradientRequest

from . import numcheck, numcheck_batched, quantities, tensors
from .config import EngineConfig
from .devices import is_random, one_cpu_thread, seeded
from .graph.meta_check import attention_elements
from .graph.program import FloatDType, where_step
from .numcheck import ProgressCallback
from .passes import Pass
from .prepared import Batch, Prepared


def numerical_check(prep: Prepared, request: GradientRequest, config: EngineConfig, device: torch.device,
                    progress: ProgressCallback | None, returned: dict[str, torch.Tensor],
                    reference: dict[str, torch.Tensor] | None = None, job_s: float = 0.0, final: Pass | None = None,
                    hvp_vector: dict[str, torch.Tensor] | None = None,
                    per_sample_sum: dict[str, torch.Tensor] | None = None):
    """Finite differences against float64 autograd, and `returned` (the gradients as the caller gets
    them) against that same float64 autograd: full batch, no checkpointing, same dropout masks. What is
    checked (mode, elements, directions, step, tolerances) follows from the request alone; `job_s` is
    not read (callers pass the measured forward+backward, which the plan must not follow)."""
    opts = prep.options
    if opts.numcheck == "off":
        return numcheck.unchecked(prep.dtype)
    ref = _Reference(prep, request, device)
    if reference is not None:
        reference.update({n: g.detach().to("cpu") for n, g in ref.grads.items()})
    plan = _plan(prep, config, ref)
    with one_cpu_thread(device, numcheck.nominal_eval_s(ref.work) <= SMALL_EVAL_S):
        check = numcheck.run(plan.mode, ref.params, ref.loss_fn, ref.grads, eps=opts.numcheck_eps,
                             tolerance=opts.numcheck_tolerance, samples=plan.samples, directions=plan.directions,
                             seed=ref.seed, progress=progress, returned=returned, returned_dtype=computed_dtype(prep),
                             batched=ref.batched(prep), returned_tolerances=ref.returned_tolerances(computed_dtype(prep)))
        if final is not None:
            check.quantities = _quantity_checks(prep, final, ref.params, ref.loss_fn, ref.model64, ref.x64, ref.t64,
                                                hvp_vector, per_sample_sum, ref.seed, device)
            check.passed = check.passed and all(q.passed for q in check.quantities.values())
    check.reason = f"{plan.reason}; {check.reason}" if check.reason else plan.reason
    check.budget_evaluations, check.cut, check.held = plan.budget, plan.cut, ref.held()
    return check


# An evaluation this small (on the nominal machine) runs on one thread: with the cores busy, an intra-op
# team's wake-ups cost more than its ops (a ResNet block's float64 forward on a loaded 2-core machine: 0.2 ms
# on one thread, 2-40 ms on two), and the check is hundreds of such evaluations. The kernels are the same.
SMALL_EVAL_S = 5e-3


def _plan(prep: Prepared, config: EngineConfig, ref: "_Reference") -> numcheck.Plan:
    """The request's plan: the mode it names, or auto's choice within the budget's evaluations."""
    opts = prep.options
    samples = opts.numcheck_samples or config.numcheck_samples
    fits = numcheck.budget_evaluations(ref.work, config.numcheck_budget, config.numcheck_budget_min_s)
    if opts.numcheck != "auto":
        return numcheck.Plan(opts.numcheck, samples, config.numcheck_directions,
                             f"{opts.numcheck}: asked for by options.numcheck")
    plan = numcheck.plan_auto([p.numel() for p in ref.params.values()], fits, exact_max=config.numcheck_exact_max,
                              samples=samples, directions=config.numcheck_directions)
    why = (f"auto chose {plan.reason}, {config.numcheck_budget:g} x the job's forward+backward + "
           f"{config.numcheck_budget_min_s:g} s on a nominal machine (an evaluation: {ref.work.ops} ops, "
           f"{ref.work.elements} output elements, {ref.work.flops} flops)")
    return plan._replace(reason=why)


class _Reference:
    """The float64 side of the check: a float64 copy of the model on the request's batch, its loss as a
    function of the trainable parameters (dropout masks replayed from the seed, detached values held),
    autograd's gradients of it, and what one evaluation does (`work`), counted on the way."""

    def __init__(self, prep: Prepared, request: GradientRequest, device: torch.device) -> None:
        trainable = [n for n, _ in prep.model.named_parameters() if n not in prep.frozen]
        self.prep, self.device, self.seed = prep, device, request.model.seed
        self.model64 = model64 = copy.deepcopy(prep.model).to(torch.float64)
        if prep.graph is not None:
            model64.upcast_all = True  # a float64 function of the parameters, whatever casts the model makes
            model64.held = {}  # the first forward records each detach's value; every later one replays it
        self.x64 = prep.inputs.map(lambda x, _: x.to(torch.float64) if x.is_floating_point() else x)
        self.t64 = {k: (v.to(torch.float64) if v.dtype.is_floating_point else v) for k, v in prep.targets.items()}
        self.params = {n: p for n, p in model64.named_parameters() if n in trainable}
        for n, p in model64.named_parameters():
            p.requires_grad_(n in self.params)
        self.random = is_random(model64)
        with _counting(model64, graph=prep.graph is not None) as counts, FlopCounterMode(display=False) as flops:
            loss = self.loss_fn()
        self.loss = float(loss.detach())
        self.work = numcheck.Work(*counts, flops=flops.get_total_flops())
        grads = torch.autograd.grad(loss, list(self.params.values()), materialize_grads=True)
        self.grads = dict(zip(self.params, grads))

    def loss_fn(self) -> torch.Tensor:
        with seeded(self.seed, self.device, self.random):
            out = self.model64(*self.x64.tensors)
            return sum(t.weight * t(out, self.t64.get(t.name)) for t in self.prep.terms)

    def batched(self, prep: Prepared):
        """Many perturbed losses a call (numcheck_batched.py) where the model allows it, else None."""
        graph = prep.graph is not None
        if not numcheck_batched.batchable(self.model64, self.device, graph=graph, random=self.random):
            return None
        return numcheck_batched.batched(self.model64, self.x64.tensors, self.t64, prep.terms, self.work.elements)

    def held(self) -> list[str]:
        """Each value the differences held at its unperturbed point, by node (graph models)."""
        held = getattr(self.model64, "held", None) or {}
        steps = self.model64._graph.steps if held else []
        return [where_step(steps[i]) for i in sorted(held)]

    def returned_tolerances(self, dtype: torch.dtype) -> dict[str, float]:
        """Each tensor's returned-gradient tolerance at `dtype`: the dtype's own, widened to what rounding
        every value of the forward at `dtype` moves the float64 gradient (numcheck.arithmetic_tolerances)."""
        base = numcheck.returned_tolerance(dtype)
        if dtype == torch.float64:
            return dict.fromkeys(self.grads, base)
        gen = torch.Generator().manual_seed(self.seed)
        with _rounding(self.model64, torch.finfo(dtype).eps, gen, graph=self.prep.graph is not None):
            loss = self.loss_fn()
        rounded = torch.autograd.grad(loss, list(self.params.values()), materialize_grads=True, allow_unused=True)
        return numcheck.arithmetic_tolerances(dtype, self.grads, dict(zip(self.params, rounded)))


def _rounded(value, args: tuple, unit: float, gen: torch.Generator):
    """`value` (a tensor, or a tuple or list of them) with each floating element moved by a rounding of
    relative size up to unit x sqrt(n), n the op's reduction length (its tensor inputs' elements per output
    element, 1 for an elementwise op); drawn from `gen`."""
    if isinstance(value, (tuple, list)):
        return type(value)(_rounded(v, args, unit, gen) for v in value)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or not value.numel():
        return value
    read = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
    reduction = max(1.0, read / value.numel())
    noise = torch.rand(value.shape, generator=gen, dtype=torch.float64).to(value.device).mul_(2).sub_(1)
    return value * (1 + unit * math.sqrt(reduction) * noise.to(value.dtype))


@contextlib.contextmanager
def _rounding(model: torch.nn.Module, unit: float, gen: torch.Generator, *, graph: bool) -> Iterator[None]:
    """While the block runs the model, every op's output is rounded as `_rounded` does (graph nodes, or
    a layer spec's leaf modules)."""
    if graph:
        model.visit = lambda _i, out, args, kwargs: _rounded(out, (*args, *kwargs.values()), unit, gen)
        try:
            yield
        finally:
            model.visit = None
        return
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(lambda _m, args, out: _rounded(out, args, unit, gen)) for m in leaves]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _counting(model: torch.nn.Module, *, graph: bool) -> Iterator[list[int]]:
    """Counts, while the block runs the model, [ops, output elements]: modules' outputs (hooks) for a layer
    spec, nodes' outputs for a graph (its modules only hold parameters)."""
    counts = [0, 0]

    def count(outs) -> None:
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        counts[0] += 1
        counts[1] += sum(t.numel() for t in outs if isinstance(t, torch.Tensor))

    if graph:
        steps = model._graph.steps

        def visit(i, out, args, kwargs) -> None:
            count(out)
            # batched calls run attention on its math kernel, which builds the attention matrix too
            counts[1] += attention_elements(steps[i], args, kwargs)

        model.visit = visit
        try:
            yield counts
        finally:
            model.visit = None
        return
    handles = [m.register_forward_hook(lambda _m, _a, out: count(out)) for m in model.modules()]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


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
