"""Batch-flow analysis: which nodes of a graph mix the examples of a batch (so micro-batches, per-sample
gradients and shards would not add up to the batch's gradient), where the batch sits in the first output,
and which nodes draw dropout masks. Read from the shapes of two meta runs at batch sizes b and b + 1."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import torch

from .interpreter import GraphModel
from .program import DTYPES, Ref, Step

_TRAINING_ARG = MappingProxyType({"aten.batch_norm.default": "training", "aten.native_batch_norm.default": "training"})
_NORMALIZED = frozenset({"aten.layer_norm.default", "aten.native_layer_norm.default", "aten.rms_norm.default"})


def batch_mixing_nodes(model: GraphModel, input_shape: list[int] | tuple[int, ...]) -> list[tuple[str, str, str]]:
    """batch_flow's mixing nodes: the first input of `input_shape`, any other at its exported shape, all
    batched along dim 0."""
    b = int(input_shape[0])
    shapes = [list(input_shape)] + [[b, *(spec.shape or [0])[1:]] for spec in model.input_specs[1:]]
    return batch_flow(model, shapes)[0]


def batch_flow(model: GraphModel, input_shapes: list[list[int]], *, batched: list[bool] | None = None
               ) -> tuple[list[tuple[str, str, str]], tuple[int, int] | None]:
    """(node, op, module path) of every node that mixes the examples of a batch, so that micro-batches,
    per-sample gradients and shards would not add up to the whole batch's gradient; and where the batch
    sits in the first output ((dim, rows per example), None where it is gone or mixed).

    `input_shapes` are the user inputs' shapes; `batched` says which carry the batch along dim 0 (all
    by default); the others keep their shape. The graph runs on meta at the batch size of the batched
    inputs and at one more; a dimension whose size
    changes between the two carries the batch. Each tensor's batch is tracked as (dim, inner): dim q of
    size outer * batch * inner, whose example index is (position // inner) % batch. A node mixes when it
    reduces or reorders along that dim (sum, softmax, sort, gather, ...), normalises over it (batch norm
    in training mode, layer norm over it), loses it (a full reduction, a matmul contracting it), changes
    its size in a way no example owns (a slice or concatenation of the batch), or reshapes across it. A
    graph whose second run fails (a static export: its batch size is baked into the graph) is reported
    at the node that failed."""
    batched = list(batched) if batched is not None else [True] * len(input_shapes)
    b1 = next((int(s[0]) for s, b in zip(input_shapes, batched) if b), 1)
    runs = []
    for batch in (b1, b1 + 1):
        shapes_in = [[batch, *shape[1:]] if b else list(shape) for shape, b in zip(input_shapes, batched)]
        xs = [torch.empty(shape, dtype=DTYPES.get(spec.dtype or "", model.run_dtype), device="meta")
              for shape, spec in zip(shapes_in, model.input_specs)]
        shapes: dict[int, Any] = {slot: tuple(x.shape) for slot, x in zip(model._users, xs)}
        for slot, kind, owner, attr in model._holders:
            shapes[slot] = tuple((owner._parameters if kind == "parameter" else owner._buffers)[attr].shape)
        for slot, target in model._consts:
            shapes[slot] = tuple(model._graph.constants[target].shape)
        steps = model._graph.steps
        try:
            with torch.no_grad(), torch.device("meta"):
                model.run(*xs, visit=lambda i, out, a, k: shapes.__setitem__(steps[i].slot, _shape_of(out)))
        except Exception:
            failed = model.failed_node if model.failed_node is not None and model.failed_node >= 0 else 0
            step = steps[failed]
            return [(step.name, step.op.name, step.module)], None
        runs.append(shapes)
    flow = _BatchFlow(runs[0], runs[1], b1, [slot for slot, b in zip(model._users, batched) if b])
    mixing = [(s.name, s.op.name, s.module) for s in model._graph.steps if not s.op.is_assert and flow.mixes(s)]
    first = model._graph.outputs[0]
    where = flow.info.get(first.i) if isinstance(first, Ref) else None
    return mixing, (where if isinstance(where, tuple) and not mixing else None)


def draws_masks(step: Step) -> bool:
    """A node that draws dropout masks: dropout with p > 0 and train not False, or a recurrent op of
    several layers with dropout between them in training mode, or any other random op (randn_like, ...)."""
    if step.op.random:
        return True
    if step.op.recurrent:
        dropout, layers = _arg(step, "dropout"), _arg(step, "num_layers")
        return _arg(step, "train") is not False and dropout != 0 and layers != 1
    if any(p.name == "dropout_p" for p in step.op.params):  # attention with dropout inside (sdpa and its kernels)
        return bool(_arg(step, "dropout_p"))
    if "dropout" not in step.op.name:
        return False
    return _arg(step, "p") != 0 and _arg(step, "train") is not False


def _shape_of(out: Any) -> Any:
    """A tensor's shape (a tuple), several tensors' (a list), a size's value (an int), else None."""
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (list, tuple)):
        return [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in out]
    if isinstance(out, int) and not isinstance(out, bool):
        return out
    return None


def _arg(step: Step, name: str) -> Any:
    positional = [p for p in step.op.params if not p.kwarg_only]
    for idx, p in enumerate(positional):
        if p.name == name and idx < len(step.args):
            return step.args[idx]
    if name in step.kwargs:
        return step.kwargs[name]
    return next((p.default for p in step.op.params if p.name == name), None)


class _BatchFlow:
    """Where the batch sits in each value (slot -> (dim, inner), a list of them for several outputs,
    or None), node after node, from the shapes of two meta runs at batch sizes b and b + 1."""

    def __init__(self, shapes1: dict, shapes2: dict, b1: int, inputs: list[int]) -> None:
        self.s1, self.s2, self.b1 = shapes1, shapes2, b1
        self.info: dict[int, Any] = {slot: (0, 1) for slot in inputs}
        self.tainted: set[int] = set(inputs)
        # arange(batch) and its views and casts: indexing the batch dim with it picks each example itself
        # (`logits[torch.arange(batch), last_token]`, as Hugging Face sequence classifiers pool).
        self.iota: set[int] = set()

    def mixes(self, step: Step) -> bool:
        refs = [a for a in step.args if isinstance(a, Ref)] + \
            [x for a in step.args if isinstance(a, list) for x in a if isinstance(x, Ref)] + \
            [v for v in step.kwargs.values() if isinstance(v, Ref)]
        # Only values computed from the inputs' data can carry one example into another; an index
        # built from sizes (arange over the batch, position ids expanded to it) carries none.
        if step.op.returns != "scalar" and any(r.i in self.tainted for r in refs):
            self.tainted.add(step.slot)
        self._track_iota(step, refs)
        if step.op.name == "operator.getitem":
            src = self.info.get(step.args[0].i)
            self.info[step.slot] = src[step.args[1]] if isinstance(src, list) and step.args[1] < len(src) else None
            return False
        s1, s2 = self.s1.get(step.slot), self.s2.get(step.slot)
        if not isinstance(s1, (tuple, list)):
            return False  # a size or a bool, not data
        batched = [(r, self.info[r.i]) for r in refs if isinstance(self.info.get(r.i), tuple)]
        data = [(r, where) for r, where in batched if r.i in self.tainted]
        if isinstance(s1, list):
            outs = [self._output(step, a, b, batched, data) for a, b in zip(s1, s2)]
            self.info[step.slot] = [o for o, _ in outs]
            return any(m for _, m in outs) or self._along(step, data)
        out, mixes = self._output(step, s1, s2, batched, data)
        self.info[step.slot] = out
        return mixes or self._along(step, data)

    def _track_iota(self, step: Step, refs: list[Ref]) -> None:
        name = step.op.name
        if name in ("aten.arange.default", "aten.arange.start"):
            end, start = _arg(step, "end"), (_arg(step, "start") if name == "aten.arange.start" else 0)
            if isinstance(end, Ref) and start == 0 and (self.s1.get(end.i), self.s2.get(end.i)) == (self.b1, self.b1 + 1):
                self.iota.add(step.slot)
        elif refs and refs[0].i in self.iota and (step.op.aliases_input or name.startswith(("aten._to_copy",
                                                                                            "aten.to.", "aten.clone"))):
            self.iota.add(step.slot)

    def _output(self, step: Step, s1: Any, s2: Any, batched: list, data: list) -> tuple[Any, bool]:
        b1 = self.b1
        if s1 is None:
            return None, False
        if len(s1) != len(s2):
            return None, bool(data)
        dims = [d for d in range(len(s1)) if s1[d] != s2[d]]
        if not dims:
            return None, bool(data)  # the batch is gone: reduced, contracted or sliced away
        if len(dims) > 1:
            return None, bool(data)  # (batch, batch): every example against every other
        q = dims[0]
        if step.op.reshapes and batched:
            ref, (p, k) = batched[0]
            stride = k * math.prod(self.s1[ref.i][p + 1:])  # flat distance between examples' blocks
            after = math.prod(s1[q + 1:])
            if after == 0 or stride % after:
                return None, bool(data)
            inner = stride // after
            if s1[q] % (b1 * inner) or s1[q] // (b1 * inner) != s2[q] // ((b1 + 1) * inner):
                return None, bool(data)
            return (q, inner), False
        for ref, (p, k) in batched:
            shape_in = self.s1.get(ref.i)
            if isinstance(shape_in, tuple) and p < len(shape_in) and shape_in[p] == s1[q]:
                return (q, k), False
        if s1[q] == b1 and s2[q] == b1 + 1:
            return (q, 1), False
        return None, bool(data)  # the batch dim changed size: a slice or concatenation of the batch

    def _along(self, step: Step, batched: list) -> bool:
        if not batched:
            return False
        op = step.op
        if op.name in _TRAINING_ARG:
            return bool(_arg(step, _TRAINING_ARG[op.name]))
        ref, (p, _) = batched[0]
        rank = len(self.s1[ref.i]) if isinstance(self.s1.get(ref.i), tuple) else None
        if op.name in _NORMALIZED:
            shape = _arg(step, "normalized_shape")
            n = len(shape) if isinstance(shape, list) else 1
            return rank is not None and p >= rank - n
        if op.name == "aten.scaled_dot_product_attention.default":  # attends along dim -2 of query and key
            return any(p == len(self.s1[r.i]) - 2 for r, (p, _) in batched if isinstance(self.s1.get(r.i), tuple))
        if op.recurrent:
            return self._recurrent_mixes(step)
        if op.name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"):
            indices = _arg(step, "indices") or []
            return p < len(indices) and indices[p] is not None and \
                not (isinstance(indices[p], Ref) and indices[p].i in self.iota)
        if op.name.startswith("function."):
            return True  # a custom Function is opaque: what it does across the batch is not known here
        if not op.along_dim:
            return False
        dim = _arg(step, "dims") if any(q.name == "dims" for q in op.params) else _arg(step, "dim")
        if dim is None or dim == []:
            return True
        dims = dim if isinstance(dim, list) else [dim]
        if rank is None or any(not isinstance(d, int) for d in dims):
            return True
        return any(d % max(rank, 1) == p for d in dims)

    def _recurrent_mixes(self, step: Step) -> bool:
        """gru/lstm/rnn combine everything but the rows of their batch dim (time steps, features, layers):
        `input`'s dim 0 (batch_first) or 1, and dim 1 of each initial state (layers, batch, hidden). An
        unbatched 2-d input has no such dim. Data with the batch anywhere else, or with the examples in
        blocks of different sizes in `input` and the states (rows paired across examples), mixes."""
        source = _arg(step, "input")
        rank = len(self.s1[source.i]) if isinstance(source, Ref) and isinstance(self.s1.get(source.i), tuple) else 0
        rows = (0 if _arg(step, "batch_first") else 1) if rank == 3 else None
        states = _arg(step, "hx")
        states = states if isinstance(states, list) else [states]
        expected = [(source, rows)] + [(r, 1 if rows is not None else None) for r in states] + \
            [(r, None) for r in _arg(step, "params") or []]
        inner = set()
        for ref, want in expected:
            where = self.info.get(ref.i) if isinstance(ref, Ref) and ref.i in self.tainted else None
            if isinstance(where, tuple):
                if where[0] != want:
                    return True
                inner.add(where[1])
        return len(inner) > 1
