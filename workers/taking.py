"""A GradientWorker's take (gradsvc/broker/takes.py says what a take is and why no job is lost or run twice):
the jobs it took beyond the one it dequeued, handed to RQ's work loop one at a time in place of a dequeue."""

from __future__ import annotations

import collections
import logging

from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import JobStatus

from gradsvc.broker import keys
from gradsvc.broker.takes import Takes

from .leasing import REDIS_ERRORS

log = logging.getLogger("gradsvc.worker")


class Taking:
    """`n`: the most jobs one take holds, the dequeued one included (GRADSVC_WORKER_TAKE; 1: no take)."""

    def __init__(self, worker, n: int) -> None:
        self.worker = worker
        self.n = n
        self.takes = Takes(worker.connection, worker.prefix, worker.name) if worker.connection is not None else None
        self.pending: collections.deque = collections.deque()  # (job id, its Queue), in the order taken
        self.current: str | None = None  # the taken job being started: its start transaction removes it
        self.owed = False  # Redis failed mid-take: what the taken list holds is given back once Redis answers
        # The taken jobs peek() read, by id: each is started from this record, its status read again (_fetch), so
        # a job read for a combined computation is not read and decoded a second time as it starts.
        self.peeked: dict = {}

    def after_dequeue(self, queue) -> None:
        """Takes up to n - 1 more jobs from `queue`, the queue the dequeued job came from (never an own queue)."""
        if self.n <= 1 or self.takes is None or keys.own_queue_worker(self.worker.prefix, queue.name) is not None:
            return
        try:
            ids = self.takes.take(queue.name, self.n - 1)
        except REDIS_ERRORS as exc:  # the script may have run, its reply lost: whatever it took goes back later
            self.owed = True
            log.warning("worker %s: a take failed (%s); the dequeued job runs alone", self.worker.name, exc)
            return
        self.pending.extend((job_id, queue) for job_id in ids)

    def next(self):
        """The next taken job still queued, as RQ's dequeue returns it ((job, queue)), or None when none is left.
        With this worker's own lease possibly lapsed, the rest is given back instead (gradsvc/broker/takes.py)."""
        try:
            if self.owed:
                self.give_back("Redis failed during a take")
                self.owed = False
            return self._next()
        except REDIS_ERRORS as exc:  # the rest stays on the taken list, given back once Redis answers
            self.pending.clear()
            self.peeked.clear()
            self.current, self.owed = None, True
            log.warning("worker %s: Redis failed while starting a taken job (%s)", self.worker.name, exc)
            return None

    def _next(self):
        worker = self.worker
        while self.pending:
            if not worker.leases.lease_fresh():
                self.give_back("its lease may have lapsed")
                return None
            job_id, queue = self.pending.popleft()
            job = self._fetch(job_id)
            if job is None or job.get_status(refresh=False) not in (JobStatus.QUEUED, None):
                worker.connection.lrem(self.takes.key, 1, job_id)  # deleted or canceled while taken
                continue
            self.current = job_id
            return job, queue
        self.peeked.clear()
        return None

    def _fetch(self, job_id: str):
        """The taken job's record: the one peek() read with its status read again (a job canceled or deleted
        since is seen), else read now; None when it is gone."""
        worker = self.worker
        job = self.peeked.pop(job_id, None)
        if job is None:
            try:
                return worker.job_class.fetch(job_id, connection=worker.connection, serializer=worker.serializer)
            except NoSuchJobError:
                return None
        try:
            job.get_status(refresh=True)  # one HGET
        except InvalidJobOperation:  # no status: the record is gone (RQ writes one as it enqueues)
            return None
        return job

    def peek(self, skip: set[str] | frozenset = frozenset()) -> list:
        """The taken jobs not started yet and still queued, but those in `skip`, read in one pipeline
        (workers/combining.py)."""
        worker = self.worker
        ids = [job_id for job_id, _ in self.pending if job_id not in skip]
        if not ids:
            return []
        jobs = worker.job_class.fetch_many(ids, connection=worker.connection, serializer=worker.serializer)
        jobs = [j for j in jobs if j is not None and j.get_status(refresh=False) in (JobStatus.QUEUED, None)]
        self.peeked.update((j.id, j) for j in jobs)
        return jobs

    def on_start(self, pipe, job) -> None:
        """Adds to the start transaction the taken job's removal from the taken list."""
        if self.current is not None and self.current == job.id:
            pipe.lrem(self.takes.key, 1, job.id)
        self.current = None

    def give_back(self, why: str) -> None:
        if self.takes is None or self.n <= 1:
            return
        self.pending.clear()
        self.peeked.clear()
        self.current = None
        n = self.takes.give_back()
        if n:
            log.info("worker %s: %d taken job(s) put back at the front of their queues (%s)", self.worker.name, n, why)

