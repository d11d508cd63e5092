"""The float64 side of the numerical check (`Reference`): a float64 copy of the model on the request's batch
and dropout masks, its loss as a function of the trainable parameters (detached and no_grad values held,
written buffers restored), autograd's gradients of it, what one evaluation does (`Work`, counted on the way),
the simulated rounding that sets the returned gradients' tolerance, and the dtype those went through."""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from gradsvc.wire import GradientRequest

from .. import tensors
from ..devices import is_random, seeded
from ..graph.meta_check import attention_elements
from ..prepared import Prepared
from ..graph.program import FloatDType, where_step
from . import batched as batched_losses
from .plan import Work
from .near_kinks import AtKinks, NearKinks
from .tolerances import arithmetic_tolerances, kink_tolerances, matmul_unit, returned_tolerance


class Reference:
    """The float64 side of the check: a float64 copy of the model on the request's batch, its loss as a
    function of the trainable parameters (dropout masks replayed from the seed, detached values held),
    autograd's gradients of it, and what one evaluation does (`work`), counted on the way."""

    def __init__(self, prep: Prepared, request: GradientRequest, device: torch.device, math_mode: str = "ieee") -> None:
        trainable = [n for n, _ in prep.model.named_parameters() if n not in prep.frozen]
        self.prep, self.device, self.seed = prep, device, request.model.seed
        self.math_mode = math_mode  # the float32 math the job's own passes ran in (devices.float32_math)
        self.model64 = model64 = copy.deepcopy(prep.model).to(torch.float64)
        if prep.graph is not None:
            model64.upcast_all = True  # a float64 function of the parameters, whatever casts the model makes
            model64.hold()  # the first forward records the held values; every later one replays them
        self._padded = [] if prep.graph is not None else _hold_padding_rows(model64)
        self.x64 = prep.inputs.map(lambda x, _: x.to(torch.float64) if x.is_floating_point() else x)
        self.t64 = {k: (v.to(torch.float64) if v.dtype.is_floating_point else v) for k, v in prep.targets.items()}
        self.params = {n: p for n, p in model64.named_parameters() if n in trainable}
        for n, p in model64.named_parameters():
            p.requires_grad_(n in self.params)
        self.random = is_random(model64)
        # The buffers a forward writes (running statistics, an EMA teacher's weights), as they were: each
        # evaluation starts from them, so that every one is the same function of the parameters.
        self.buffers = [(b, b.detach().clone()) for b in _written_buffers(model64, graph=prep.graph is not None)]
        with _counting(model64, graph=prep.graph is not None) as counts, FlopCounterMode(display=False) as flops:
            loss = self.loss_fn()
        self.loss = float(loss.detach())
        self.work = Work(*counts, flops=flops.get_total_flops())
        grads = torch.autograd.grad(loss, list(self.params.values()), materialize_grads=True)
        self.grads = dict(zip(self.params, grads))
        if prep.graph is not None:
            self._hold_kinks()

    def _hold_kinks(self) -> None:
        """The elements at a kink held on autograd's branch in every later forward (near_kinks.AtKinks)."""
        self._near = near = NearKinks(self.model64._graph.steps)
        with near.recording(self.model64), torch.no_grad():
            self.loss_fn()
        at = AtKinks(near)
        if at.at:
            self.model64.before, self.model64.visit = at.before, at.visit

    def loss_fn(self, inputs: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """The loss on the request's batch (or `inputs`), from the same buffers and dropout masks every call."""
        return sum(t.weight * loss for t, loss in zip(self.prep.terms, self.term_losses(inputs)))

    def term_losses(self, inputs: tuple[torch.Tensor, ...] | None = None) -> list[torch.Tensor]:
        """Each loss term's value (unweighted), as `loss_fn` computes them."""
        self.restore_buffers()
        with seeded(self.seed, self.device, self.random):
            out = self.model64(*(self.x64.tensors if inputs is None else inputs))
            return [t(out, self.t64.get(t.name)) for t in self.prep.terms]

    def restore_buffers(self) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)

    def batched(self, prep: Prepared):
        """Many perturbed losses a call (batched.py) where the model allows it, else None."""
        graph = prep.graph is not None
        if not batched_losses.batchable(self.model64, self.device, graph=graph, random=self.random):
            return None
        return batched_losses.batched(self.model64, self.x64.tensors, self.t64, prep.terms, self.work.elements)

    def held(self) -> list[str]:
        """Each value the differences held at its unperturbed point, by node (graph models)."""
        held = getattr(self.model64, "held", None) or {}
        padded = getattr(self.model64, "padding_steps", {})
        steps = self.model64._graph.steps if held or padded else []
        return [where_step(steps[i]) for i in sorted(held)] + [
            f"{where_step(steps[i])}: the rows at padding_idx {pad}" for i, pad in sorted(padded.items())] + [
            f"layer {name} (Embedding): the rows at padding_idx {pad}" for name, pad in self._padded]

    def returned_tolerances(self, dtype: torch.dtype) -> dict[str, float]:
        """Each tensor's returned-gradient tolerance at `dtype` under the float32 math that ran (`math_mode`):
        the dtype's own (TF32's where it ran), widened to what rounding every value of the forward at `dtype`
        (a convolution's or matmul's at TF32's unit where it ran) moves the float64 gradient
        (tolerances.arithmetic_tolerances)."""
        math_mode = self.math_mode
        base = returned_tolerance(dtype, math_mode)
        if dtype == torch.float64:
            return dict.fromkeys(self.grads, base)
        gen = torch.Generator().manual_seed(self.seed)
        units = (torch.finfo(dtype).eps, matmul_unit(dtype, math_mode))
        graph = self.prep.graph is not None
        near = getattr(self, "_near", None)  # each kink op's float64 input, kept once (_hold_kinks)
        if near is not None:
            near.near = {}
        with _rounding(self.model64, units, gen, graph=graph, near=near):
            loss = self.loss_fn()
        rounded = torch.autograd.grad(loss, list(self.params.values()), materialize_grads=True, allow_unused=True)
        tolerances = arithmetic_tolerances(dtype, self.grads, dict(zip(self.params, rounded)), math_mode)
        if near is None or not near.near:
            return tolerances
        with near.flipping(self.model64):  # the elements within rounding's reach of a kink on its other branch
            loss = self.loss_fn()
        flipped = torch.autograd.grad(loss, list(self.params.values()), materialize_grads=True, allow_unused=True)
        return kink_tolerances(dtype, tolerances, self.grads, dict(zip(self.params, flipped)))


class _PaddingHold:
    """A forward hook on a layer spec's nn.Embedding(padding_idx=k): its first output recorded, every later one
    with the padding positions' rows as recorded. Autograd defines the padding row's gradient as 0 although the
    forward reads it, so finite differences hold it, as the graph interpreter holds them (GraphModel)."""

    def __init__(self, padding_idx: int) -> None:
        self.padding_idx = padding_idx
        self.first: torch.Tensor | None = None

    def __call__(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = out.detach()
            return out
        if out.shape != self.first.shape:  # another batch (none in the check): nothing recorded for it
            return out
        return torch.where((args[0] == self.padding_idx).unsqueeze(-1), self.first, out)


def _hold_padding_rows(model: torch.nn.Module) -> list[tuple[str, int]]:
    """Each nn.Embedding with a padding_idx hooked (_PaddingHold): (its name, its padding_idx)."""
    held = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None:
            m.register_forward_hook(_PaddingHold(m.padding_idx))
            held.append((name, m.padding_idx))
    return held


def _written_buffers(model: torch.nn.Module, *, graph: bool) -> list[torch.Tensor]:
    """The buffers a forward of `model` may write: a graph's buffer mutations, a layer spec's every buffer."""
    if graph:
        return [getattr(owner, attr) for owner, attr, _ in model._mutations]
    return list(model.buffers())


def _rounded(value, args: tuple, unit: float, gen: torch.Generator, terms: torch.Tensor | None = None):
    """`value` (a tensor, or a tuple or list of them) with each floating element moved by a rounding of
    relative size up to unit x sqrt(n), n the op's reduction length (its tensor inputs' elements per output
    element, 1 for an elementwise op); drawn from `gen`. `terms`, a sum of products' (a matmul's, a
    convolution's) sum of |term| per element: an element whose terms cancel is moved by what rounding them
    moves it, unit x sqrt(n) x terms / sqrt(n), not by a rounding of its own small size."""
    if isinstance(value, (tuple, list)):
        return type(value)(_rounded(v, args, unit, gen) for v in value)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or not value.numel():
        return value
    if _aliases(value, args):
        # A view (select, slice) or an in-place op's result (copy_, add_): a rounded copy would take its place,
        # and the writes through it would miss the tensor it views (an ODE's trajectory filled as ys[i] = y would
        # stay zeros); its values were rounded where they were computed.
        return value
    read = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
    reduction = max(1.0, read / value.numel())
    size = unit * math.sqrt(reduction)
    noise = torch.rand(value.shape, generator=gen, dtype=torch.float64).to(value.device).mul_(2).sub_(1)
    out = value * (1 + size * noise.to(value.dtype))
    if terms is not None and terms.shape == value.shape:
        excess = (terms / math.sqrt(reduction) - value.detach().abs()).clamp_(min=0)
        out = out + size * noise.to(value.dtype) * excess
    if out.requires_grad:
        # The backward's arithmetic rounds too: the gradient flowing into this value, by the same unit (its noise
        # drawn now, in forward order, so that the backward's order cannot change the figures). A deep network
        # whose batch statistics divide by small variances loses most of its float32 precision there.
        back = torch.rand(value.shape, generator=gen, dtype=torch.float64).to(value.device).mul_(2).sub_(1)
        out.register_hook(lambda g: g * (1 + size * back.to(g.dtype)))
    return out


def _absolute(value):
    """`value` (args, kwargs) with each floating tensor's absolute value, the rest as it is."""
    if isinstance(value, dict):
        return {k: _absolute(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_absolute(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().abs()
    return value


def _module_terms(module: torch.nn.Module, args: tuple) -> torch.Tensor | None:
    """A layer spec's nn.Linear's or convolution's sum of |term| per output element (_rounded's `terms`)."""
    linear = isinstance(module, torch.nn.Linear)
    conv = isinstance(module, torch.nn.modules.conv._ConvNd) and not module.transposed
    if not (linear or conv) or not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        return None
    with torch.no_grad():
        x = args[0].detach().abs()
        bias = None if module.bias is None else module.bias.detach().abs()
        if linear:
            return torch.nn.functional.linear(x, module.weight.detach().abs(), bias)
        return module._conv_forward(x, module.weight.detach().abs(), bias)


# What runs as a convolution or a matmul (TF32 rounds their operands): layer-spec leaf modules, graph ops by name.
MATMUL_MODULES = (torch.nn.Linear, torch.nn.Bilinear, torch.nn.modules.conv._ConvNd, torch.nn.RNNBase)
MATMUL_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.matmul.", "aten.linear.", "aten.mv.",
              "aten.addmv.", "aten.einsum.", "aten.convolution.", "aten._convolution.", "aten.conv1d.",
              "aten.conv2d.", "aten.conv3d.", "aten.conv_transpose", "aten.scaled_dot_product_attention.",
              "aten._scaled_dot_product", "aten.gru.", "aten.lstm.", "aten.rnn_tanh.", "aten.rnn_relu.")
# Sums of products, linear in each operand: run on their operands' absolute values, each output element's sum of
# |term| (_rounded's `terms`). The matmuls and convolutions but einsum (a product of any number of operands),
# attention (a softmax between its products) and the RNNs (nonlinear).
PRODUCT_OPS = tuple(op for op in MATMUL_OPS if op not in ("aten.einsum.", "aten.scaled_dot_product_attention.",
                    "aten._scaled_dot_product", "aten.gru.", "aten.lstm.", "aten.rnn_tanh.", "aten.rnn_relu."))


def _aliases(value: torch.Tensor, args: tuple) -> bool:
    """Whether `value` shares its storage with a tensor among `args` (an op's view or in-place result)."""
    if value.is_sparse or value.layout != torch.strided:
        return False
    storage = value.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.layout == torch.strided and not a.is_sparse
               and a.untyped_storage().data_ptr() == storage for a in args)


@contextlib.contextmanager
def _rounding(model: torch.nn.Module, units: tuple[float, float], gen: torch.Generator, *,
              graph: bool, near: NearKinks | None = None) -> Iterator[None]:
    """While the block runs the model, every op's output is rounded as `_rounded` does (graph nodes, or
    a layer spec's leaf modules): `units` (every op's unit, a convolution's or matmul's); `near` marks the
    elements the rounding brings within reach of a kink (near_kinks.py)."""
    unit, matmul = units
    if graph:
        steps = model._graph.steps

        def visit(i, out, args, kwargs):
            if near is not None:
                kept = near.mark(i, out, args, kwargs)
                out = out if kept is None else kept
            op = steps[i].op
            u = matmul if op.name.startswith(MATMUL_OPS) else unit
            terms = None
            if op.name.startswith(PRODUCT_OPS) and isinstance(out, torch.Tensor):
                with torch.no_grad():
                    terms = op.fn(*_absolute(args), **_absolute(kwargs))
            return _rounded(out, (*args, *kwargs.values()), u, gen, terms)

        saved, model.visit = model.visit, visit
        try:
            with near.simulating(model) if near is not None else contextlib.nullcontext():
                yield
        finally:
            model.visit = saved
        return
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(lambda m, args, out: _rounded(
        out, args, matmul if isinstance(m, MATMUL_MODULES) else unit, gen, _module_terms(m, args)))
        for m in leaves]
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
            if steps[i].op.name.startswith(RECURRENT_OPS) and len(args) >= 9 and isinstance(args[0], torch.Tensor):
                counts[0] += _recurrent_ops(args[0], num_layers=args[4], bidirectional=args[7], batch_first=args[8])

        model.visit = visit
        try:
            yield counts
        finally:
            model.visit = None
        return
    def hook(m: torch.nn.Module, args, out) -> None:
        count(out)
        if isinstance(m, torch.nn.RNNBase) and args and isinstance(args[0], torch.Tensor):
            counts[0] += _recurrent_ops(args[0], num_layers=m.num_layers, bidirectional=m.bidirectional,
                                        batch_first=m.batch_first)

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


# A recurrent layer is one op (one node or module) that loops over its sequence: each time step of each layer
# and direction counts this many ops (a cell's matmuls and gates).
RECURRENT_OPS = ("aten.gru.", "aten.lstm.", "aten.rnn_tanh.", "aten.rnn_relu.")
RECURRENT_STEP_OPS = 4


def _recurrent_ops(x: torch.Tensor, *, num_layers: int, bidirectional: bool, batch_first: bool) -> int:
    """The ops a recurrent layer's loop over `x` (its input: (L, N, H), (N, L, H) batch first, or (L, H)) adds."""
    length = x.shape[1] if batch_first and x.dim() == 3 else x.shape[0]
    return RECURRENT_STEP_OPS * length * int(num_layers) * (2 if bidirectional else 1)


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
