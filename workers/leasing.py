"""A GradientWorker's leases, kept from its heartbeat thread (workers/worker.py says why leases).

Every heartbeat the thread renews the worker's key and its running job's lease, registers the worker again
when Redis lost its key, and reaps the jobs whose leases lapsed (any worker's); every WATCHDOG_S it runs the
job's watchdog and moves the jobs that waited too long in any worker's own queue (gradsvc/broker/affinity.py). A job whose renewal failed (Redis unreachable or refusing writes) is asked of Redis before its
lease is renewed again or its outcome recorded: it may have been reaped meanwhile, and then it stays failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import worker_registration
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.job import Job, JobStatus
from rq.utils import now, utcformat
from rq.worker import SimpleWorker

from gradsvc.broker import devices, keys
from gradsvc.broker import handoff as handoff_files
from gradsvc.broker.affinity import Mover
from gradsvc.broker.connection import REFUSAL_ERRORS
from gradsvc.broker.handoff import Handoff
from gradsvc.broker.job import GradientJob
from gradsvc.broker.leases import LeaseRegistry, lease_s

from .watchdog import WATCHDOG_S, Running, Watchdog

log = logging.getLogger("gradsvc.worker")
# Redis unreachable, or answering but refusing writes (at maxmemory, read-only after a failover): both are
# waited out the same way, rather than the work loop dying on the first refused heartbeat.
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, *REFUSAL_ERRORS)


class Leases:
    """One worker's lease and its running job's (`running`, set by the worker while a job runs), renewed by
    the heartbeat thread that start() starts and stop() ends. `handoff`: the worker's, where a reaped job's
    result file goes."""

    def __init__(self, worker: SimpleWorker, heartbeat_s: int, watchdog: Watchdog, handoff: Handoff | None) -> None:
        self.worker = worker
        self.handoff = handoff
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s(heartbeat_s)  # a worker or job silent this long is lost
        self.watchdog = watchdog  # run by the heartbeat thread
        self.running: Running | None = None
        self.beating = threading.Event()
        self.mover: Mover | None = None  # set by the worker (its queue prefix)
        self.beaten = time.monotonic()  # when the worker's key was last renewed (its own lease)
        self.idle: Callable[[], object] | None = None  # called while no job runs (the worker's memory trim)

    def start(self) -> None:
        self.watchdog.listen_for_signals()
        self.beating.set()
        self.watchdog.thread = threading.Thread(target=self._loop, name="gradsvc-heartbeat", daemon=True)
        self.watchdog.thread.start()

    def stop(self) -> None:
        self.beating.clear()

    def _loop(self) -> None:
        name = self.worker.name
        next_beat = time.monotonic()
        while self.beating.is_set():
            try:
                self.watchdog.watch(self.running)
                if self.running is None and self.idle is not None:
                    self.idle()
                if self.mover is not None:
                    moved = self.mover.move_overdue()
                    if moved:
                        log.info("worker %s: moved %d job(s) out of a busy or gone worker's own queue", name,
                                 len(moved))
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.heartbeat_s
                    self.beat()
                    self.sweep_gone()
            except REDIS_ERRORS as exc:
                if (running := self.running) is not None:
                    running.lease_failed = True
                log.warning("worker %s: heartbeat failed, Redis unreachable or refusing writes (%s); retrying", name, exc)
            except Exception:  # the thread must outlive any surprise, or every job would be reaped
                log.exception("worker %s: heartbeat failed", name)
            time.sleep(min(WATCHDOG_S, self.heartbeat_s))

    def beat(self) -> None:
        """Renews this worker's lease and its running job's, then fails any job whose lease lapsed."""
        worker, running = self.worker, self.running
        if running is not None and not running.overdue(time.monotonic()) and not running.reaped:
            # A wedged job's lease lapses. After Redis was unreachable, the lease is renewed only if the job
            # was not reaped meanwhile (renewing would put a failed job back in the started registry).
            if running.lease_failed and not self.still_ours(running):
                running.reaped = True
            else:
                worker.maintain_heartbeats(running.job, running.execution)
                running.renewed, running.lease_failed = time.monotonic(), False
        with worker.connection.pipeline() as pipe:
            pipe.hset(worker.key, "last_heartbeat", utcformat(now()))
            pipe.expire(worker.key, self.lease_s)
            # Not hset's "created": the running job's heartbeat above writes last_heartbeat into a hash it
            # makes anew when Redis came back empty, and the worker then never registered again.
            pipe.sismember(worker_registration.REDIS_WORKER_KEYS, worker.key)
            pipe.hexists(worker.key, "queues")
            if worker.device is not None:  # what the API sizes this device's limits by (gradsvc/broker/devices.py)
                devices.publish(pipe, worker.prefix, worker.key, worker.device)
            _, _, listed, registered, *_ = pipe.execute()
        self.beaten = time.monotonic()
        if not (listed and registered):  # the hash had expired, or Redis came back empty: register again
            self._register_again()
        self.reap_abandoned()

    def sweep_gone(self) -> None:
        """A gone worker's own queue emptied into the shared queues and forgotten (gradsvc/broker/affinity.py)."""
        if self.mover is None:
            return
        moved = self.mover.sweep_gone(keys.queue_name(self.worker.prefix, "auto"))
        if moved:
            log.warning("worker %s: moved %d job(s) out of a gone worker's own queue", self.worker.name, moved)

    def _register_again(self) -> None:
        worker = self.worker
        log.warning("worker %s: registering again (its key was gone from Redis)", worker.name)
        with worker.connection.pipeline() as pipe:
            pipe.hset(worker.key, mapping={**worker.serialize(), "state": worker.get_state()})
            worker_registration.register(worker, pipe)
            pipe.expire(worker.key, self.lease_s)
            pipe.execute()

    def reap_abandoned(self) -> None:
        """RQ fails a started job whose lease lapsed (AbandonedJobError): its worker died or lost Redis."""
        for queue in self.worker.queues:
            # LeaseRegistry: from this heartbeat thread, a reaped shard must still fail its job.
            LeaseRegistry(queue=queue, job_class=queue.job_class, serializer=queue.serializer).cleanup()
        taking = getattr(self.worker, "taking", None)
        if taking is not None and taking.takes is not None:
            given = taking.takes.reap()  # a gone worker's taken jobs, queued again
            if given:
                log.warning("worker %s: %d job(s) taken by a gone worker queued again", self.worker.name, given)

    def lease_fresh(self) -> bool:
        """Whether this worker's own key has at least a heartbeat of its lease left (gradsvc/broker/takes.py)."""
        return time.monotonic() - self.beaten < self.lease_s - self.heartbeat_s

    def still_ours(self, running: Running) -> bool:
        status, worker = self.worker.connection.hmget(running.job.key, "status", "worker_name")
        return status == JobStatus.STARTED.value.encode() and worker == self.worker.name.encode()

    def reaped(self, job: Job) -> bool:
        """Whether the job was failed (worker_lost) while this worker was cut off from Redis (a partition
        longer than its lease): then its outcome is dropped, so a client told worker_lost never sees it end a
        second time. Asked of Redis only when a lease renewal failed or lapsed: one round trip, on those jobs."""
        running = self.running
        if running is None or running.job.id != job.id:
            return False
        if not running.reaped and (running.lease_failed or
                                   time.monotonic() - running.renewed >= self.lease_s - self.heartbeat_s):
            running.reaped = not self.still_ours(running)
        if not running.reaped:
            return False
        log.warning("worker %s: job %s was reported lost while this worker was cut off from Redis; its outcome "
                    "is dropped (the job ends once, as reported)", self.worker.name, job.id)
        self._drop_outcome(job)
        return True

    def _drop_outcome(self, job: Job) -> None:
        try:
            # Redis restarted empty: the job's progress wrote its meta into a hash of its own, with no status
            # (read as job_lost) and no TTL. A record that was failed as worker_lost keeps the TTL it has.
            self.worker.connection.expire(job.key, job.failure_ttl or DEFAULT_FAILURE_TTL, nx=True)
        except REDIS_ERRORS:
            pass  # Redis gone again: nothing of the job's was written since either
        pending = getattr(job, "pending_result", None)
        if pending is not None:
            handoff_files.drop(pending[1], self.handoff)
        if isinstance(job, GradientJob):
            job.pending_result = None
