"""The numerical check's batched evaluation: many perturbed losses of a model in one call, over torch.func.vmap,
where the model is a pure function of its parameters (`batchable`); how many a call may hold, and the calls an
element-wise check makes (`_plan`, `_perturbed`). A failed batched call falls back to the one-at-a-time loop
(exact.py, directional.py), which stays the reference."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..losses import LOSSES, OWN_LOSS, LossTerm

# One batched call holds at most this many float64 elements, its perturbed copies and its activations
# together (32 MiB).
BATCH_ELEMENTS = 1 << 22
# Batching pays where one evaluation is small (its ~20-60 us of Python and dispatch outweigh its arithmetic):
# an evaluation (row) holding more elements than this, perturbed tensors and activations, runs in the loop.
# Measured once each on a loaded 2-core machine (bench/numcheck_cost.py's MLPs, directional): 2.2x faster
# at 10,330 parameters, 0.8x at 103,210 and 0.3x at 1,032,010, where a row's copies and batched matmuls
# cost more than the loop's overhead.
ROW_ELEMENTS_MAX = 1 << 16
# What a failed batched call raises (torch.func's missing batching rules and refusals, a kernel's errors,
# running out of memory): the check falls back to the loop. Anything else (the worker's job timeout, which
# RQ raises asynchronously wherever the job is, a cancellation) goes through.
BATCH_FAILURES = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError, AssertionError,
                  ArithmeticError, MemoryError)


class Batched(NamedTuple):
    """Many perturbed losses in one call. `losses` takes {name: (K, *shape)} (the other parameters at their
    current values) and gives the K losses, float64; `row_elements` is what one evaluation holds beyond its
    perturbed tensors (the forward's activations), to size the chunks."""
    losses: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    row_elements: int = 0

    def rows(self, perturbed_elements: int) -> int:
        """How many evaluations one call may hold when each perturbs `perturbed_elements` elements: 0 where
        such an evaluation is too large to batch (over ROW_ELEMENTS_MAX), or two would not fit a call."""
        row = max(1, perturbed_elements + self.row_elements)
        rows = BATCH_ELEMENTS // row
        return rows if row <= ROW_ELEMENTS_MAX and rows >= 2 else 0


# Graph ops with no vmap rule (per_sample refuses them too), and custom Functions (no vmap staticmethod).
_UNBATCHABLE_OPS = ("aten.gru.", "aten.lstm.", "aten.rnn_tanh.", "aten.rnn_relu.", "function.")


def batchable(model: torch.nn.Module, device: torch.device, *, graph: bool, random: bool) -> bool:
    """Whether the check may evaluate many perturbed losses of `model` in one call (`batched`): only where a
    loss is a pure function of the parameters. Not random models (every evaluation forks the same dropout
    masks), layer specs with buffers (BatchNorm updates its running statistics in training mode), graphs
    that write a buffer (buffer mutations), an Embedding with max_norm (it renormalises its weight in
    place), recurrent layers and custom Functions (no vmap rule), nor off the CPU (not measured there)."""
    if device.type != "cpu" or random:
        return False
    if graph:
        return not model._graph.mutations and not any(s.op.name.startswith(_UNBATCHABLE_OPS) or s.writes_buffer
                                                      for s in model._graph.steps)
    return (next(model.buffers(), None) is None
            and not any(isinstance(m, torch.nn.RNNBase) or (isinstance(m, torch.nn.Embedding) and m.max_norm is not None)
                        for m in model.modules()))


def batched(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], targets: dict[str, torch.Tensor], terms: list[LossTerm],
            row_elements: int = 0) -> Batched:
    """`model`'s loss (sum of term.weight * term(out, target)) at K perturbed parameter sets in one call:
    torch.func.vmap over functional_call for the forward, then each term unreduced over the K x batch rows
    in one plain call, reduced row by row (vmap's rule for cross_entropy costs more than the forward)."""
    from torch.func import functional_call, vmap

    state = {n: p.detach() for n, p in model.named_parameters()}  # live views: the loop's in-place writes show

    def output(perturbed: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, {**state, **perturbed}, tuple(inputs))

    outputs = vmap(output)

    def losses(perturbed: dict[str, torch.Tensor]) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):  # attention as matmuls and softmax, which vmap batches
            out = outputs(perturbed)
        return sum(t.weight * _rows_loss(t, out, targets.get(t.name)) for t in terms)

    return Batched(losses, row_elements)


def _rows_loss(term: LossTerm, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """term(out[k], target) for each row k of `out` (K, *output shape): the K rows folded into the batch
    dimension, the loss unreduced, then reduced per row as term.reduction says ("mean" over every element
    of the unreduced loss, as torch's mean is with no class weights and no ignored targets)."""
    k = out.shape[0]
    if term.type == OWN_LOSS:  # (K, 1...) : the model's own scalar loss at each parameter set
        return out.reshape(k)
    fn, kind = LOSSES[term.type]
    if kind == "class" and out.dim() >= 3:  # (K, N, C, ...) against (N, ...) indices or (N, C, ...) probabilities
        per = fn(out.flatten(0, 1), target.expand(k, *target.shape).flatten(0, 1), reduction="none")
    else:  # shaped alike, or an unbatched (C,) class output against a () index or (C,) probabilities
        per = fn(out, target.expand(k, *target.shape), reduction="none")
    per = per.reshape(k, -1)
    return per.mean(1) if term.reduction == "mean" else per.sum(1)



Segment = tuple[str, int, int]  # (tensor, first, last + 1): elements of picks[tensor] one batched call perturbs


def _plan(params: dict[str, torch.Tensor], picks: dict[str, torch.Tensor], batched: Batched) -> list[list[Segment]]:
    """The batched calls of an element-wise check: consecutive tensors share a call while its rows (2 per
    element) times the elements each row holds (every tensor of the call, plus the activations) stay within
    BATCH_ELEMENTS; a tensor too large for that is split over calls of its own, and one too large to batch
    (`Batched.rows` 0: over ROW_ELEMENTS_MAX, or two rows over BATCH_ELEMENTS) is left to the loop."""
    calls: list[list[Segment]] = []
    call: list[Segment] = []
    rows = elements = 0  # the open call's
    for name, ix in picks.items():
        n, k = params[name].numel(), len(ix)
        if k == 0:
            continue
        if call and batched.rows(elements + n) >= rows + 2 * k:
            call.append((name, 0, k))
            rows, elements = rows + 2 * k, elements + n
            continue
        if call:
            calls.append(call)
            call, rows, elements = [], 0, 0
        per = batched.rows(n) // 2  # elements of this tensor one call may perturb
        if per < 1:
            continue
        for start in range(0, k, per):
            stop = min(start + per, k)
            call = [(name, start, stop)]
            rows, elements = 2 * (stop - start), n
            if stop < k:
                calls.append(call)
        # the last (or only) piece stays open: the next tensors may join it
    if call:
        calls.append(call)
    return calls


def _perturbed(params: dict[str, torch.Tensor], picks: dict[str, torch.Tensor], call: list[Segment],
               eps: float) -> dict[str, torch.Tensor]:
    """One batched call's rows, over the tensors of its segments: first one row per element with that element
    at orig + eps, then one per element at orig - eps (the values the loop writes), in segment order; every
    other element of those tensors at its value. One block, each tensor a view of its columns."""
    names = list(dict.fromkeys(name for name, _, _ in call))
    flats = [params[name].detach().reshape(-1) for name in names]
    offsets = dict(zip(names, [0, *torch.tensor([f.numel() for f in flats]).cumsum(0).tolist()]))
    base = torch.cat(flats) if len(flats) > 1 else flats[0]
    cols = torch.cat([picks[name][start:stop] + offsets[name] for name, start, stop in call]).to(base.device)
    half = len(cols)
    block = base.expand(2 * half, base.numel()).clone()
    at = torch.arange(half, device=base.device)
    vals = base[cols]
    block[at, cols] = vals + eps
    block[at + half, cols] = vals - eps
    return {name: block[:, offsets[name]:offsets[name] + flat.numel()].view(2 * half, *params[name].shape)
            for name, flat in zip(names, flats)}
