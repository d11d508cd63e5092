"""`gradsvc worker`: an RQ worker that runs jobs in its own process (no fork per job), so imported
torch and the CUDA context stay warm; it serves its Prometheus metrics on its own port.

RQ's SimpleWorker does not heartbeat while a job runs, so it registers each job for job_timeout + 60 s:
a worker killed mid-job would leave its job "started" for that long. GradientWorker instead leases a
job for 3 heartbeats and renews the lease from a thread every GRADSVC_WORKER_HEARTBEAT_S, so a long
job stays alive while a dead worker's job expires within seconds; the same thread reaps expired
leases (RQ fails them with AbandonedJobError, which the API reports as `worker_lost`). Losing Redis
is waited out: the worker retries until it comes back instead of exiting.

The heartbeat thread (workers/leasing.py) also runs the job's watchdog (workers/watchdog.py: hard deadline,
cancel and SIGTERM inside one long op). The process entry (`gradsvc worker`) is workers/main.py: it makes the
process's WorkerContext (workers/jobs.py) and gives it to the worker, which hands it to each job it runs. Each
SimpleWorker method overridden here, and each private name of RQ or redis-py used, is listed with its reason
in gradsvc/broker/internals.py.
"""

from __future__ import annotations

import logging
import time

from redis.client import EMPTY_RESPONSE
from redis.exceptions import ResponseError
from rq import Queue
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.rate_limit import release_slot
from rq.utils import now
from rq.worker import SimpleWorker, WorkerStatus

from gradsvc.broker import devices, keys
from gradsvc.broker.affinity import Mover
from gradsvc.broker.connection import refusal
from gradsvc.broker.devices import WorkerDevice
from gradsvc.broker.job import GRADIENT_JOB, GradientJob
from gradsvc.broker.record import JobMeta
from gradsvc.runtime.malloc import MemoryKeeper

from .jobs import WorkerContext, hand_over
from .leasing import REDIS_ERRORS, Leases
from .session_host import SessionSweep
from .taking import Taking
from .transaction import SentTransaction
from .watchdog import Running, Watchdog

# RQ records a job's function by its dotted path; the pipelined dequeue compares it to this one's.
_JOB_FUNCTION = GRADIENT_JOB

log = logging.getLogger("gradsvc.worker")
SUSPENSION_CHECK_S = 1.0
# How long a stopping worker waits for RQ's pubsub thread (its command channel) to end; a daemon, it ends with
# the process if it has not ended by then (GradientWorker.unsubscribe).
PUBSUB_STOP_S = 1.0


class GradientWorker(SimpleWorker):
    """SimpleWorker: a forking worker adds ~20 ms per job with torch loaded and cannot reuse a CUDA context.
    `context`: the process's WorkerContext, made by its entry (workers/main.py build_worker); a worker made
    without one (`rq worker -w workers.worker.GradientWorker`) fails each gradsvc job it takes, saying so."""

    # Reconnect within a few seconds of Redis coming back (RQ's default backoff grows to 60 s).
    exponential_backoff_factor = 1.5
    max_connection_wait_time = 3.0

    def __init__(self, *args, heartbeat_s: int = 2, prefix: str = "gradsvc", context: WorkerContext | None = None,
                 take: int = 1, **kwargs) -> None:
        # worker_ttl sets the idle BLPOP to worker_ttl - 15 s; the heartbeat thread keeps the key alive.
        kwargs.setdefault("worker_ttl", 30)
        kwargs.setdefault("job_monitoring_interval", heartbeat_s)
        super().__init__(*args, **kwargs)
        self.context = context
        self.prefix = prefix
        self.device: WorkerDevice | None = None  # published with each heartbeat (workers/main.py sets it)
        self.watchdog = Watchdog(self)
        handoff = context.handoff if context is not None else None
        self.leases = Leases(self, heartbeat_s, self.watchdog, handoff)  # kept by the heartbeat thread
        if self.connection is not None:
            self.leases.mover = Mover(self.connection, prefix)
        self.lease_s = self.leases.lease_s  # a worker or job silent this long is lost
        self._starting = None  # prepare_execution's open pipeline, executed by prepare_job_execution
        self._started: SentTransaction | None = None  # its MULTI/EXEC, sent, its reply not read yet
        self._deferred = None  # a kept result's start transaction, not sent: written with the job's end
        self._suspension_checked = float("-inf")
        # After warm-up (workers/main.py builds the worker after it); the heartbeat thread trims when idle.
        self.memory = MemoryKeeper(held=context.host_held_bytes if context is not None else lambda: 0)
        self.leases.idle = self.memory.when_idle
        if context is not None:  # the sessions it holds that are gone, dropped first
            self.leases.idle = SessionSweep(context, self.connection, self.name, then=self.memory.when_idle)
        self.taking = Taking(self, take)  # the jobs taken with the one dequeued (workers/taking.py)

    # --- leases (renewed by the heartbeat thread: workers/leasing.py) --------------------------------
    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.lease_s

    def heartbeat(self, timeout: int | None = None, pipeline=None):
        if pipeline is not None:
            return super().heartbeat(timeout or self.lease_s, pipeline=pipeline)
        if self.leases.beating.is_set():
            # The heartbeat thread keeps this worker's key alive; RQ's own calls around every dequeue
            # would add three Redis round trips to each job.
            return None
        try:
            return super().heartbeat(timeout or self.lease_s)
        except REDIS_ERRORS as exc:  # the dequeue loop that follows backs off until Redis returns
            log.warning("worker %s: heartbeat failed, Redis unreachable or refusing writes (%s)", self.name, exc)

    def set_state(self, state: str, pipeline=None):
        if pipeline is not None:
            return super().set_state(state, pipeline=pipeline)
        if state == self._state:
            # RQ sets IDLE after each job and again before each dequeue; the success transaction already
            # wrote it (handle_job_success): a round trip each, saved.
            return None
        try:
            return super().set_state(state)
        except REDIS_ERRORS:
            self._state = state  # advisory only; the next heartbeat re-registers the worker

    # --- one job's Redis round trips -------------------------------------------------------------------
    # RQ's SimpleWorker makes about ten per job around the function; these overrides keep every record it
    # writes (Execution, StartedJobRegistry, statuses, the results stream, FinishedJobRegistry, worker
    # state and counters) and write them in two transactions: one before the job, one after.
    def prepare_execution(self, job: Job) -> Execution:
        """RQ's prepare_execution (Execution record, worker BUSY), its pipeline left open for
        prepare_job_execution to add its writes to: one transaction instead of two."""
        pipe = self.connection.pipeline()
        execution = Execution.create(job, self.get_heartbeat_ttl(job), pipeline=pipe, worker_name=self.name)
        self.executions[execution.id] = execution
        self.set_state(WorkerStatus.BUSY, pipeline=pipe)
        self._starting = pipe
        # A shard stops on its parent job's flag (DELETE, or a failed sibling), as workers/jobs.py polls it.
        shard = JobMeta.of(job.meta).shard
        cancel_id = shard.parent if shard else job.id
        self.leases.running = Running(job, execution, time.monotonic(), keys.cancel_key(self.prefix, cancel_id))
        return execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        """RQ's prepare_job_execution (worker and job heartbeats, job STARTED, its key persisted), written
        with prepare_execution's records in one MULTI/EXEC; for a job whose result a take's combined computation
        kept (workers/combining.py), held and written with its end in handle_job_success's transaction."""
        pipe, self._starting = self._starting, None
        if pipe is None:
            return super().prepare_job_execution(job, remove_from_intermediate_queue)
        try:
            _start_writes(self, job, pipe, remove_from_intermediate_queue)
            if _kept(self, job):
                self._deferred, pipe = pipe, None  # its start and end written at once, one transaction
            # Sent now, its reply read when the job ends (handle_execution_ended): the job starts without
            # waiting a round trip (0.24 ms of a 3.5 ms small request here). Redis runs the transaction as
            # it arrives, before any write the job or the worker sends later on another connection.
            elif any(EMPTY_RESPONSE in options for _, options in pipe.command_stack):
                pipe.execute()  # a command redis-py answers without sending it: its own path
            else:
                self._started = SentTransaction(pipe)
        finally:
            if pipe is not None:
                pipe.reset()

    def _settle_start(self) -> None:
        """Reads the start transaction's reply; raises its first error (the job then fails, or, with Redis
        gone, is reported worker_lost as any job whose outcome could not be recorded)."""
        started, self._started = self._started, None
        if started is not None:
            started.settle()

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        """RQ also writes the job's heartbeat here, a round trip of its own; the job's final save (in the
        success or failure transaction) writes it, and the heartbeat thread keeps the lease meanwhile."""
        self._settle_start()
        job.ended_at = now()
        job.last_heartbeat = job.ended_at

    def handle_job_failure(self, job: Job, queue: Queue, *args, **kwargs) -> None:
        self.watchdog.yield_to_hard_stop()
        if self.leases.reaped(job):
            return
        _write_held(self)
        super().handle_job_failure(job, queue, *args, **kwargs)

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry, execution: Execution) -> None:
        """RQ's, for a job nothing depends on (a plain gradient job; shards have their reduce job): no WATCH
        on, and no read of, the dependents set (two round trips), and the worker's IDLE state written in the
        same transaction. Other jobs take RQ's own path."""
        self.watchdog.yield_to_hard_stop()
        if self.leases.reaped(job):
            return
        if job.func_name != _JOB_FUNCTION or job.repeats_left:
            _write_held(self)
            super().handle_job_success(job, queue, started_job_registry, execution)
            if isinstance(job, GradientJob):
                if not job.result_flushed:
                    job.flush_result(self.connection)  # result_ttl 0: RQ skipped _handle_success
                job.pending_result = None
            return
        pipe, self._deferred = self._deferred, None  # a kept result's held start: written first, in this transaction
        with pipe if pipe is not None else self.connection.pipeline() as pipe:
            _end_writes(self, job, execution, pipe)
            job._status = JobStatus.FINISHED
            # The IDLE state written, but the worker still busy until it is: a SIGTERM meanwhile (RQ's _shutdown
            # asks get_state()) stops it after this job instead of raising inside the transaction.
            pipe.hset(self.key, "state", WorkerStatus.IDLE)
            pipe.execute()
        self._state = WorkerStatus.IDLE
        if isinstance(job, GradientJob):
            job.pending_result = None
        release_slot(job)

    def execute_job(self, job: Job, queue: Queue) -> None:
        hand_over(job, self.context)  # the job functions' state (workers/jobs.py run_job)
        try:
            super().execute_job(job, queue)
        except REDIS_ERRORS as exc:
            # The job's outcome could not be recorded; its lease lapses and it is reaped as worker_lost.
            log.error("worker %s: Redis lost while finishing job %s (%s); it will be reported as worker_lost",
                      self.name, job.id, exc)
            self._wait_a_moment()
        finally:
            self.leases.running = None
            if self._started is not None:  # the job ended without handle_execution_ended: drop the reply
                self._started.drop()
                self._started = None
            if self._deferred is not None:  # its outcome dropped (reaped) or not written: it never started here
                _give_back_held(self)
            self.memory.after_job()
            if self.context is not None:
                self.context.refresh_graphs()  # the job's graph TTL refreshes, on the reaper thread

    def bootstrap(self, *args, **kwargs) -> None:
        super().bootstrap(*args, **kwargs)
        self.leases.start()

    def teardown(self) -> None:
        self.leases.stop()
        try:
            self.taking.give_back("the worker stops")
        except REDIS_ERRORS as exc:  # its key expires with its lease; any heartbeat then gives them back
            log.warning("worker %s: could not give back its taken jobs (%s)", self.name, exc)
        try:
            if self.device is not None:
                devices.withdraw(self.connection, self.prefix, self.key)
            super().teardown()
        except REDIS_ERRORS as exc:
            log.warning("worker %s: could not register its death, Redis unreachable or refusing writes (%s)", self.name, exc)

    def unsubscribe(self) -> None:
        """RQ's, with its wait for the pubsub thread bounded as RQ means it to be. RQ unsubscribes, whose reply
        wakes the thread from its blocking read, then stops the thread; but redis-py's stop() waits for it
        without a bound, and a thread that read the reply before stop() cleared its flag sits out RQ's 60 s
        wait for a subscription that never comes: the worker outlived its SIGTERM by up to a minute (more
        often the busier its other threads keep the GIL). The thread now gets PUBSUB_STOP_S; the connection
        is then closed under it (it waits on an Event, not on the socket) and it ends with the process."""
        thread = self.pubsub_thread
        if thread is None:
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        self.pubsub.unsubscribe()
        thread.stop(timeout=PUBSUB_STOP_S)
        self.pubsub.close()

    # --- Redis outages in the work loop --------------------------------------------------------------
    def check_for_suspension(self, burst: bool) -> None:
        """RQ asks Redis before every dequeue whether `rq suspend` was run (a round trip per job, with a
        worker heartbeat the heartbeat thread already sends); here at most once a second, so a suspended
        worker may still take the jobs queued within that second."""
        now_s = time.monotonic()
        if now_s - self._suspension_checked < SUSPENSION_CHECK_S:
            return
        self._suspension_checked = now_s
        try:
            super().check_for_suspension(burst)
        except REDIS_ERRORS as exc:
            log.warning("worker %s: Redis unreachable or refusing writes (%s); waiting for it", self.name, exc)
            self._wait_a_moment()

    def run_maintenance_tasks(self) -> None:
        try:
            super().run_maintenance_tasks()
        except REDIS_ERRORS as exc:
            log.warning("worker %s: registry maintenance skipped, Redis unreachable or refusing writes (%s)", self.name, exc)
            self.last_cleaned_at = now()

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None):
        """RQ's dequeue, waiting out Redis refusing writes as RQ waits out a lost connection: a failover's
        demotion cuts the blocked BLPOP (UNBLOCKED) and a full Redis refuses the writes around it (OOM). A job
        taken with an earlier one (workers/taking.py) comes first, without a dequeue; a dequeued job takes more."""
        taken = self.taking.next()
        if taken is not None:
            job, queue = taken
            job.redis_server_version = self.get_redis_server_version()
            self.log.info("Worker %s: %s: %s (%s)", self.name, queue.name, job.description, job.id)  # as RQ's dequeue
            return taken
        while True:
            try:
                result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
                if result is not None:
                    self.taking.after_dequeue(result[1])
                return result
            except ResponseError as exc:
                if refusal(exc) is None:
                    raise
                log.warning("worker %s: Redis refuses writes (%s); waiting for it", self.name, str(exc)[:200])
                self._wait_a_moment()

    def _wait_a_moment(self) -> None:
        time.sleep(1.0)



# --- a job's start transaction (GradientWorker.prepare_job_execution) ----------------------------------------------
def _start_writes(worker: GradientWorker, job: Job, pipe, remove_from_intermediate_queue: bool) -> None:
    """RQ's prepare_job_execution's writes (worker and job heartbeats, job STARTED, its key persisted), added to
    `pipe`, and the taken job's removal from the taken list."""
    ttl = worker.get_heartbeat_ttl(job)
    worker.heartbeat(ttl, pipeline=pipe)
    job.heartbeat(now(), ttl, pipeline=pipe)
    job.prepare_for_execution(worker.name, pipeline=pipe)
    pipe.persist(job.key)
    worker.taking.on_start(pipe, job)  # a taken job leaves the taken list as it starts
    if remove_from_intermediate_queue:
        pipe.lrem(Queue(job.origin, connection=worker.connection).intermediate_queue_key, 1, job.id)


def _end_writes(worker: GradientWorker, job: Job, execution: Execution, pipe) -> None:
    """RQ's success writes (handle_job_success) for a job nothing depends on, added to `pipe`: the worker's counters,
    the result (RQ's and gradsvc's), the job's TTLs, the Execution removed."""
    worker.increment_successful_job_count(pipeline=pipe)
    worker.increment_total_working_time(job.ended_at - job.started_at, pipe)
    result_ttl = job.get_result_ttl(worker.default_result_ttl)
    if result_ttl != 0:
        job._handle_success(result_ttl, pipeline=pipe, worker_name=worker.name, execution_id=execution.id,
                            execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
    if isinstance(job, GradientJob) and not job.result_flushed:
        job.flush_result(pipe)
    job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
    worker.cleanup_execution(job, pipeline=pipe, execution=execution)


def _kept(worker: GradientWorker, job: Job) -> bool:
    """Whether a take's combined computation kept the job's result (workers/combining.py)."""
    combining = getattr(worker.context, "combining", None)
    return combining is not None and job.id in combining.kept


def _write_held(worker: GradientWorker) -> None:
    """A held start transaction written alone (its job ends another way than handle_job_success's)."""
    pipe, worker._deferred = worker._deferred, None
    if pipe is not None:
        with pipe:
            pipe.execute()


def _give_back_held(worker: GradientWorker) -> None:
    """The job whose held start was not written is still on the taken list: given back with the rest, queued."""
    worker._deferred.reset()
    worker._deferred = None
    try:
        worker.taking.give_back("a kept result's job did not end here")
    except REDIS_ERRORS as exc:
        worker.taking.owed = True
        log.warning("worker %s: could not give back its taken jobs (%s)", worker.name, exc)
