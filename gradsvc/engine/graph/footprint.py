"""Memory an op takes that its output does not show, for the meta-device check of graph models
(graph.check_graph_shapes): the dense kernels' copies of their inputs.

A matmul, a convolution or an einsum runs BLAS (or oneDNN) on dense operands: an input that is a view
holding more elements than its storage (an `expand`, an overlapping `unfold`: stride 0 or overlapping
strides) is first copied out whole, and a matmul broadcasting one operand's batch dims against the other's
expands and copies that operand. A convolution's CPU path may unfold its input into columns (im2col:
in-channels x kernel x output positions, per sample). None of these buffers is a node's output: a
`[1, 4]` parameter expanded to `[10^5, 10^4, 4]` and multiplied by a `[4, 1]` weight outputs 10^9 elements
fewer than the 4 x 10^9 it copies. The attention matrix of scaled_dot_product_attention is counted apart
(graph.attention_elements). Pure functions of meta tensors, no torch state.
"""

from __future__ import annotations

import math
from typing import Any

import torch

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
