"""A take's jobs computed together (gradsvc/engine/combine.py says which combine and how). When a job starts while
the worker holds taken jobs behind it (workers/taking.py), their records are read in one pipeline and every
request that can run with others is computed now, in one batched computation per group; the results wait in this
process, by job id, until RQ starts each job as it starts any (the start transaction, the started registry, its
status: nothing of RQ's records changes), and its function then answers the kept result instead of computing.

A job with no kept result computes alone, as without a take: one that could not be combined, one whose group
failed, one taken again after its worker died (the kept results die with the process; the taken list goes back
to the queue: gradsvc/broker/takes.py). A result kept for a job that never starts here (canceled while taken,
given back) is dropped when the take is done.
"""

from __future__ import annotations

import logging

from rq.job import Job

from gradsvc.broker.job import GRADIENT_JOB
from gradsvc.wire import GradientRequest, GradientResult

from .jobs import WorkerContext, _graphs, _owner, _record_holder, _with_pieces, compute_request, decode_request

log = logging.getLogger("gradsvc.worker")


class Combining:
    """One worker's kept results; `taking`: its Taking (the jobs it holds)."""

    def __init__(self, taking) -> None:
        self.taking = taking
        self.kept: dict[str, tuple[GradientRequest, GradientResult]] = {}
        self.tried: set[str] = set()  # the jobs of this take already offered to a group: each is offered once

    def compute(self, job: Job, ctx: WorkerContext, body: bytes | str, fmt: str, queue_s: float) -> GradientResult:
        """The job's result: the one kept for it, else computed with the taken jobs behind it, else alone."""
        kept = self.kept.pop(job.id, None)
        if not self.taking.pending:
            self.kept.clear()  # the take is done: what is left belongs to jobs that will not start here
            self.tried.clear()
        if kept is None and job.id not in self.tried and self.taking.pending and isinstance(body, bytes):
            kept = self._together(job, ctx, body, fmt)
        if kept is None:
            return compute_request(job, ctx, body, fmt, queue_s)
        request, result = kept
        result.timings.queue_ms = 1e3 * queue_s
        ctx.metrics.observe_resident(ctx.engine.caches.resident_models)
        if result.prepared is not None:
            _record_holder(ctx, job, request, result)
        return result

    def _together(self, job: Job, ctx: WorkerContext, body: bytes, fmt: str):
        """Computes the job with the taken ones; keeps theirs and answers its own (None: it computes alone)."""
        members = [(job, body, fmt), *_peers(self.taking.peek(skip=self.tried))]
        self.tried.update(j.id for j, _, _ in members)
        requests: list[tuple[Job, GradientRequest]] = []
        for j, b, f in members:
            try:
                requests.append((j, _with_pieces(ctx, j, decode_request(b, f))))
            except Exception:  # noqa: BLE001  its own compute reports it, alone
                continue
        if len(requests) < 2:
            return None
        try:
            results = ctx.engine.combine([(r, _owner(j), _graphs(ctx, j)) for j, r in requests], ctx.device)
        except Exception:  # noqa: BLE001  a bug of the combined path must not fail the jobs: alone
            log.exception("worker: computing %d taken jobs together failed; each computes alone", len(requests))
            return None
        together = sum(1 for r in results if r is not None and r.combined)
        if together:
            log.info("worker: %d of %d taken jobs computed together", together, len(requests))
        mine = None
        for (j, request), result in zip(requests, results):
            if result is None:
                continue
            if j.id == job.id:
                mine = (request, result)
            else:
                self.kept[j.id] = (request, result)
        return mine


def _peers(jobs: list[Job]) -> list[tuple[Job, bytes, str]]:
    """The taken jobs a combined computation can read: plain gradient jobs whose body is in their record (a body
    handed over as a file is read once, by its own job)."""
    out = []
    for j in jobs:
        try:
            if j.func_name != GRADIENT_JOB:
                continue
            body, fmt = j.args
        except Exception:  # noqa: BLE001  a record RQ cannot read: its own start reports it
            continue
        if isinstance(body, bytes) and isinstance(fmt, str):
            out.append((j, body, fmt))
    return out
