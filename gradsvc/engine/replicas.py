"""A training session held by several workers (docs/sessions.md, "A session over several workers"): each member
holds a replica of the model and its optimizer. A batch of n rows is split along its first dim: rank r of k takes
rows n*r//k to n*(r+1)//k, each of its mean losses scaled by its share of the batch as a micro-batch's is
(passes.chunks), so that the parts' gradients and losses summed are the batch's. The sum is one all-reduce per
dtype over a torch.distributed process group (gloo: the collective is torch's, not written here), so every
replica applies the same optimizer step to the same weights.

Buffers follow DistributedDataParallel's rule: each replica's forward normalises by its own part's batch
statistics, and rank 0's buffers are the session's, broadcast to the others after each pass (DDP broadcasts them
before each forward). A failure on one member is agreed on before the gradients' all-reduce (`agree`), its code and
message passed through the group's store, so every member fails the call alike and none waits for a collective
another will not join; a member that died or a collective past the group's timeout is member_lost."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from torch import nn

from .errors import ComputeError, EngineError, SpecError


@dataclass(eq=False)
class Group:
    """One formation of a session's members: the process group, the store its rendezvous used (rank 0 serves it:
    kept alive with the group), this member's rank, and the formation's id (the call that formed it)."""

    pg: Any
    store: Any
    rank: int
    size: int
    formation: str
    calls: int = 0  # the collective calls agreed on so far: each one's keys in the store are its own

    def part(self, rows: int) -> tuple[int, int]:
        if rows < self.size:
            raise SpecError("bad_option", f"the batch has {rows} rows, fewer than the {self.size} workers holding "
                              "the session: send at least one row per worker", option="inputs", rows=rows,
                              workers=self.size)
        return rows * self.rank // self.size, rows * (self.rank + 1) // self.size

    def agree(self, error: EngineError | None) -> None:
        """Every member says whether its part went through; when one did not, every member raises the first
        failing member's error (its own when it failed)."""
        self.calls += 1
        tag = f"error/{self.calls}"
        if error is not None:
            self.store.set(f"{tag}/{self.rank}", msgspec.msgpack.encode([error.code, error.message, error.detail]))
        ok = torch.tensor([0 if error is not None else 1], dtype=torch.int64)
        self._run(lambda: self.pg.allreduce([ok], _minimum()).wait())
        if int(ok[0]) == 1:
            return
        if error is not None:
            raise error
        for rank in range(self.size):
            if self.store.check([f"{tag}/{rank}"]):
                code, message, detail = msgspec.msgpack.decode(self.store.get(f"{tag}/{rank}"))
                raise ComputeError(code, f"worker {rank} of the session's {self.size}: {message}", **detail)
        raise ComputeError("member_lost", "another worker of the session failed this call; it was not applied: send "
                           "it again")

    def rank0_says(self, yes: bool) -> bool:
        """Rank 0's answer to a question only it can answer (whether it applied a call's idempotency key), every
        member's."""
        flag = torch.tensor([int(yes) if self.rank == 0 else 0], dtype=torch.int64)
        self._run(lambda: self.pg.broadcast([flag], _from_rank_0()).wait())
        return bool(flag[0])

    def sum_(self, tensors: list[torch.Tensor]) -> float:
        """Sums each tensor over the members in place (one all-reduce per dtype); the seconds it took."""
        started = time.perf_counter()
        self._flat(tensors, lambda flat: self.pg.allreduce([flat]))
        return time.perf_counter() - started

    def broadcast_buffers(self, model: nn.Module) -> None:
        """Rank 0's buffers into every replica (DDP's broadcast_buffers)."""
        self._flat([b for b in model.buffers() if b.numel()], lambda flat: self.pg.broadcast([flat], _from_rank_0()))

    def _flat(self, tensors: list[torch.Tensor], collective) -> None:
        """`collective` (flat -> its work) run once per dtype over the tensors concatenated, its result copied back
        into each."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self._run(lambda: collective(flat).wait())
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _run(self, collective) -> None:
        try:
            collective()
        except RuntimeError as exc:  # gloo: a peer's connection closed (it died), or the timeout passed
            raise ComputeError("member_lost", f"a worker holding part of the session stopped or did not answer "
                               f"within the collective timeout ({str(exc).splitlines()[0][:200]}); the call was not "
                               "applied: send it again, the session goes on without it", rank=self.rank) from None


def _minimum():
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return opts


def _from_rank_0():
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def reduce_pass(group: Group, names: list[str], grads: dict[str, torch.Tensor], losses: dict[str, float],
                like: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, float], float]:
    """The batch's gradients and losses from the members' parts: every trained parameter's gradient (zeros where a
    part had none) and a mask of which parts had one, summed; a parameter no part had a gradient for keeps none.
    Answers (gradients, losses, the all-reduce's seconds)."""
    full = [(grads[n].to_dense() if grads[n].is_sparse else grads[n]) if n in grads else torch.zeros_like(like[n])
            for n in names]
    terms = sorted(losses)
    scalars = torch.tensor([float(n in grads) for n in names] + [losses[t] for t in terms], dtype=torch.float64)
    seconds = group.sum_([*full, scalars])
    values = scalars.tolist()
    had = values[:len(names)]
    summed = {n: g for n, g, h in zip(names, full, had) if h > 0}
    return summed, {t: v for t, v in zip(terms, values[len(names):])}, seconds


def gather_times(group: Group, rows: int, compute_s: float, allreduce_s: float) -> list[tuple[int, float, float]]:
    """Each member's (rows, compute seconds, all-reduce seconds), by rank."""
    slots = torch.zeros(group.size, 3, dtype=torch.float64)
    slots[group.rank] = torch.tensor([rows, compute_s, allreduce_s], dtype=torch.float64)
    group.sum_([slots])
    return [(int(r), c, a) for r, c, a in slots.tolist()]
