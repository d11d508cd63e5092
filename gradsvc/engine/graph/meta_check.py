"""Shape checking on meta: a GraphModel run on the meta device names the node that cannot take its inputs
(shape_mismatch) or makes an intermediate beyond the limits (too_large), before the job is queued.

An op's footprint counts what its output does not show: the dense kernels' copies of their inputs
(workspace_elements). A matmul, a convolution or an einsum runs BLAS (or oneDNN) on dense operands: an input
that is a view holding more elements than its storage (an `expand`, an overlapping `unfold`: stride 0 or
overlapping strides) is first copied out whole, and a matmul broadcasting one operand's batch dims against the
other's expands and copies that operand. A convolution's CPU path may unfold its input into columns (im2col:
in-channels x kernel x output positions, per sample). None of these buffers is a node's output: a `[1, 4]`
parameter expanded to `[10^5, 10^4, 4]` and multiplied by a `[4, 1]` weight outputs 10^9 elements fewer than
the 4 x 10^9 it copies. The attention matrix of scaled_dot_product_attention is counted apart
(attention_elements). Pure functions of meta tensors, no torch state."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import SpecError
from ..spec import Limits
from .interpreter import GraphModel
from .program import Step, where_step


def _shapes(args: Any) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(list(a.shape))
        elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            out.append([list(x.shape) if isinstance(x, torch.Tensor) else x for x in a])
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def attention_elements(step: Step, args: list, kwargs: dict) -> int:
    """The attention matrix scaled_dot_product_attention's math kernel builds: batch x heads x L x S elements
    (query (..., L, E), key (..., S, E)); 0 for any other op. Node outputs do not show it: a [1, 1, 9000, 1]
    query outputs 9,000 elements and builds 81M."""
    if step.op.name != "aten.scaled_dot_product_attention.default" or len(args) < 2:
        return 0
    q, k = args[0], args[1]
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2 or k.dim() < 2:
        return 0
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    return math.prod(lead) * q.shape[-2] * k.shape[-2]


def validate_graph_shapes(model: GraphModel, *x_meta: torch.Tensor, limits: Limits | None = None,
                       math_attention: bool = False) -> torch.Tensor:
    """Runs the graph on the meta device: any node that cannot take its inputs is a shape_mismatch naming
    the node, op, module path and input shapes; intermediates beyond the limits are too_large. With
    `math_attention` (options.hvp: attention runs its math kernel, which has a double backward), the
    attention matrix each scaled_dot_product_attention builds counts as an intermediate too. The first
    output is returned, its requires_grad as autograd set it."""
    limits = limits or Limits()
    steps = model._graph.steps
    total = [0]

    def visit(i: int, out: Any, args: list, kwargs: dict) -> None:
        step = steps[i]
        inner = attention_elements(step, args, kwargs) if math_attention else 0
        if inner > limits.max_elements:
            raise SpecError("too_large", f"model.graph: {where_step(step)} builds an attention matrix of {inner} "
                            f"elements (batch x heads x query length x key length) for options.hvp, above the limit "
                            f"of {limits.max_elements}; send shorter sequences or a smaller batch, or leave "
                            "options.hvp out (the fused kernels do not build it)", node=step.name, elements=inner,
                            limit=limits.max_elements)
        total[0] += inner * (args[0].element_size() if inner else 0)
        _check_workspace(step, args, out, total[0], limits)
        if step.op.aliases_input and _shares_storage(out, args):
            return  # a view or an in-place result: no new memory (contiguous/reshape/to may copy instead)
        for t in _tensors(out):
            n = t.numel()
            if n > limits.max_elements:
                raise SpecError("too_large", f"model.graph: {where_step(step)} makes a tensor of shape "
                                f"{list(t.shape)} ({n} elements), above the limit of {limits.max_elements}; "
                                "send a smaller batch or model", node=step.name, shape=list(t.shape),
                                limit=limits.max_elements)
            total[0] += n * t.element_size()
        if total[0] > limits.max_graph_intermediate_bytes:
            raise SpecError("too_large", f"model.graph: the intermediates up to {where_step(step)} hold "
                            f"{total[0]} bytes, above the limit of {limits.max_graph_intermediate_bytes} a job may "
                            "use (GRADSVC_MAX_JOB_BYTES); send a smaller batch or model", node=step.name,
                            limit=limits.max_graph_intermediate_bytes)

    try:
        # With grad on (as the worker runs it, and no slower on meta): the output's requires_grad then says
        # whether a backward pass can start from it (prepare refuses a detached one before the queue).
        with torch.enable_grad(), torch.device("meta"):
            outs = model.run(*x_meta, visit=visit)
    except SpecError:
        raise
    except Exception as exc:
        i = model.failed_node
        if i is None or i < 0:
            raise SpecError("shape_mismatch", f"model.graph: the inputs do not fit the graph: {exc}") from None
        step = steps[i]
        env_args = _shapes(model.failed_args)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise SpecError("shape_mismatch", f"model.graph: {where_step(step)} cannot take inputs of shapes "
                        f"{env_args}: {first}", node=step.name, op=step.op.name, module=step.module,
                        input_shapes=env_args) from None
    return outs[0]


def _check_workspace(step: Step, args: list, out: Any, held: int, limits: Limits) -> None:
    """The buffers a dense op copies its inputs into (workspace_elements), against the element
    limit and, with the intermediates held so far, the job's memory."""
    copies, columns = workspace_elements(step.op.name, args, out)
    extra = copies + columns
    if not extra:
        return
    size = extra * next((a.element_size() for a in args if isinstance(a, torch.Tensor)), 4)
    if copies > limits.max_elements or held + size > limits.max_graph_intermediate_bytes:
        raise SpecError("too_large", f"model.graph: {where_step(step)} copies its inputs into buffers of {extra} "
                        f"elements ({size} bytes: an expanded or broadcast operand made dense, or a convolution's "
                        f"columns), above the limit of {limits.max_elements} elements per tensor or, with the "
                        f"{held} bytes held before it, of {limits.max_graph_intermediate_bytes} bytes a job may use "
                        "(GRADSVC_MAX_JOB_BYTES); materialize smaller operands or send a smaller batch",
                        node=step.name, elements=extra, limit=limits.max_elements,
                        limit_bytes=limits.max_graph_intermediate_bytes)


def _shares_storage(out: Any, args: Any) -> bool:
    """Whether `out` is (a view of) the op's first tensor argument: on meta too, storages are objects."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    outs = _tensors(out)
    if first is None or not outs:
        return False
    key = first.untyped_storage()._cdata
    return all(t.untyped_storage()._cdata == key for t in outs)


_MATMUL = frozenset({f"aten.{n}" for n in """linear.default addmm.default mm.default bmm.default matmul.default
baddbmm.default addmv.default mv.default dot.default outer.default einsum.default""".split()})
_CONV = frozenset({f"aten.{n}" for n in """conv1d.default conv2d.default conv3d.default convolution.default
conv1d.padding conv2d.padding conv3d.padding""".split()})
_CONV_T = frozenset(f"aten.{n}" for n in "conv_transpose1d.input conv_transpose2d.input conv_transpose3d.input".split())


def _spread(t: torch.Tensor) -> int:
    """The elements a dense kernel copies out of `t`: all of them when `t` views more elements than its
    storage holds (stride 0 or overlapping strides), else 0."""
    if t.numel() == 0:
        return 0
    try:
        stored = t.untyped_storage().nbytes() // max(1, t.element_size())
    except (RuntimeError, NotImplementedError):  # a tensor with no storage (a wrapper subclass)
        return 0
    return t.numel() if t.numel() > stored else 0


def workspace_elements(op: str, args: list, out: Any) -> tuple[int, int]:
    """Elements of the buffers op `op` allocates besides its output, for these (meta) arguments: (dense
    copies of its operands, a convolution's im2col columns). The copies are tensors of their own (the
    element limit applies); the columns count towards the job's memory only (oneDNN's float32 path has none)."""
    if op not in _MATMUL and op not in _CONV and op not in _CONV_T:
        return 0, 0
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if op == "aten.einsum.default" and len(args) > 1 and isinstance(args[1], (list, tuple)):
        tensors = [a for a in args[1] if isinstance(a, torch.Tensor)]
    copies = sum(_spread(t) for t in tensors)
    if op == "aten.matmul.default" and len(tensors) >= 2:
        a, b = tensors[0], tensors[1]
        if a.dim() >= 3 and b.dim() >= 3:  # a batched matmul (a 1-D or 2-D operand is folded, not expanded)
            batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
            for t in (a, b):
                if math.prod(t.shape[:-2]) < batch:  # broadcast: expanded, then copied
                    copies += batch * t.shape[-2] * t.shape[-1]
    columns = 0
    transposed = op in _CONV_T or (op == "aten.convolution.default" and len(args) > 6 and bool(args[6]))
    if (op in _CONV or transposed) and len(tensors) >= 2 and isinstance(out, torch.Tensor):
        x, w = tensors[0], tensors[1]
        if w.dim() >= 3 and x.dim() >= 3:
            # One sample's columns: (in-channels per group x kernel) x positions of the side unfolded.
            positions = math.prod(x.shape[2:]) if transposed else math.prod(out.shape[2:])
            columns = w.shape[1] * math.prod(w.shape[2:]) * positions
    return copies, columns
