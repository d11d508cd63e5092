"""`gradsvc worker`: an RQ worker that runs jobs in its own process (no fork per job), so imported
torch and the CUDA context stay warm; it serves its Prometheus metrics on its own port.

RQ's SimpleWorker does not heartbeat while a job runs, so it registers each job for job_timeout + 60 s:
a worker killed mid-job would leave its job "started" for that long. GradientWorker instead leases a
job for 3 heartbeats and renews the lease from a thread every GRADSVC_WORKER_HEARTBEAT_S, so a long
job stays alive while a dead worker's job expires within seconds; the same thread reaps expired
leases (RQ fails them with AbandonedJobError, which the API reports as `worker_lost`). Losing Redis
is waited out: the worker retries until it comes back instead of exiting.

The same thread is the job's hard deadline. RQ's timeout (SIGALRM) and DELETE's cancel flag act only
between Python steps, so a single long C++ op outlives both; past the job's timeout + HARD_STOP_GRACE_S,
or CANCEL_GRACE_S after its cancel flag appeared, the thread fails the job `timeout`/`canceled` through
RQ's own failure path, unregisters the worker and ends the process (os._exit), as RQ's forking worker
kills its work horse. Its supervisor (`gradsvc up`, compose's restart policy) starts a fresh worker.
SIGTERM/SIGINT are the same: Python runs their handlers (RQ's warm shutdown) only between steps, so the
thread sees them through the signal wakeup fd, which the C-level handler writes even while the main thread is
inside an op; a job still running TERM_GRACE_S later fails `worker_lost` and the process ends.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import torch
from redis import Redis
from redis.client import EMPTY_RESPONSE
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ExecAbortError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue, worker_registration
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.rate_limit import release_slot
from rq.utils import now, utcformat
from rq.timeouts import JobTimeoutException
from rq.worker import SimpleWorker, WorkerStatus

from gradsvc.broker import handoff as handoff_files
from gradsvc.broker import keys
from gradsvc.broker.connection import connect
from gradsvc.broker.jobs import GradientJob, MsgpackSerializer
from gradsvc.broker.leases import LeaseRegistry, lease_s
from gradsvc.runtime.malloc import cap_data, keep_large_buffers
from gradsvc.runtime.settings import Settings

from .engine import warm_up_shape_check
from .jobs import gradient_job, make_context, set_context

# RQ records a job's function by its dotted path; the pipelined dequeue compares it to this one's.
_JOB_FUNCTION = f"{gradient_job.__module__}.{gradient_job.__qualname__}"

log = logging.getLogger("gradsvc.worker")
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError)
SUSPENSION_CHECK_S = 1.0
# A job past its timeout gets this long for RQ's own timeout to stop it between steps; then it is stopped hard.
HARD_STOP_GRACE_S = 2.0
# A running job whose cancel flag is set gets this long to stop at its next step; then it is stopped hard.
CANCEL_GRACE_S = 2.0
# A job still running this long after the worker got SIGTERM/SIGINT is failed worker_lost and the process ends
# (under compose's 10 s stop timeout, before the SIGKILL that would leave the job to its lease).
TERM_GRACE_S = 5.0
# How often the heartbeat thread looks at the running job's deadline and cancel flag.
WATCHDOG_S = 0.5
# The exit status of a worker that stopped a job hard (its supervisor restarts it).
HARD_STOP_EXIT = 70


@dataclass
class _Running:
    """The job this worker runs, as its heartbeat thread watches it."""

    job: Job
    execution: Execution
    started: float  # time.monotonic()
    cancel_key: str
    canceled_at: float | None = None  # when the heartbeat thread first saw the cancel flag
    renewed: float = 0.0  # when the heartbeat thread last renewed the job's lease (time.monotonic())
    lease_failed: bool = False  # a renewal failed: Redis was unreachable, the lease may have lapsed
    reaped: bool = False  # the job was failed (worker_lost) meanwhile: its outcome is not recorded

    def __post_init__(self) -> None:
        self.renewed = self.started

    def overdue(self, at: float) -> bool:
        timeout = self.job.timeout
        return timeout is not None and timeout > 0 and at - self.started > timeout + HARD_STOP_GRACE_S


class GradientWorker(SimpleWorker):
    """SimpleWorker: a forking worker adds ~20 ms per job with torch loaded and cannot reuse a CUDA context."""

    # Reconnect within a few seconds of Redis coming back (RQ's default backoff grows to 60 s).
    exponential_backoff_factor = 1.5
    max_connection_wait_time = 3.0

    def __init__(self, *args, heartbeat_s: int = 2, prefix: str = "gradsvc", **kwargs) -> None:
        # worker_ttl sets the idle BLPOP to worker_ttl - 15 s; the heartbeat thread keeps the key alive.
        kwargs.setdefault("worker_ttl", 30)
        kwargs.setdefault("job_monitoring_interval", heartbeat_s)
        super().__init__(*args, **kwargs)
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s(heartbeat_s)  # a worker or job silent this long is lost
        self.prefix = prefix
        self._running: _Running | None = None
        self._stopping_hard = threading.Event()  # the heartbeat thread is failing the job and ending the process
        self._starting = None  # prepare_execution's open pipeline, executed by prepare_job_execution
        self._started: _SentTransaction | None = None  # its MULTI/EXEC, sent, its reply not read yet
        self._suspension_checked = float("-inf")
        self._beating = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self._signals_r: int | None = None  # the read end of the signal wakeup fd (bootstrap)
        self._term_at: float | None = None  # when the heartbeat thread saw SIGTERM/SIGINT

    # --- leases -------------------------------------------------------------------------------------
    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.lease_s

    def heartbeat(self, timeout: int | None = None, pipeline=None):
        if pipeline is not None:
            return super().heartbeat(timeout or self.lease_s, pipeline=pipeline)
        if self._beating.is_set():
            # The heartbeat thread keeps this worker's key alive; RQ's own calls around every dequeue
            # would add three Redis round trips to each job.
            return None
        try:
            return super().heartbeat(timeout or self.lease_s)
        except REDIS_ERRORS as exc:  # the dequeue loop that follows backs off until Redis returns
            log.warning("worker %s: heartbeat failed, Redis unreachable (%s)", self.name, exc)

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
        cancel_id = (job.meta.get("shard") or {}).get("parent") or job.id
        self._running = _Running(job, execution, time.monotonic(), keys.cancel_key(self.prefix, cancel_id))
        return execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        """RQ's prepare_job_execution (worker and job heartbeats, job STARTED, its key persisted), written
        with prepare_execution's records in one MULTI/EXEC."""
        pipe, self._starting = self._starting, None
        if pipe is None:
            return super().prepare_job_execution(job, remove_from_intermediate_queue)
        with pipe:
            ttl = self.get_heartbeat_ttl(job)
            self.heartbeat(ttl, pipeline=pipe)
            job.heartbeat(now(), ttl, pipeline=pipe)
            job.prepare_for_execution(self.name, pipeline=pipe)
            pipe.persist(job.key)
            if remove_from_intermediate_queue:
                pipe.lrem(Queue(job.origin, connection=self.connection).intermediate_queue_key, 1, job.id)
            # Sent now, its reply read when the job ends (handle_execution_ended): the job starts without
            # waiting a round trip (0.24 ms of a 3.5 ms small request here). Redis runs the transaction as
            # it arrives, before any write the job or the worker sends later on another connection.
            if any(EMPTY_RESPONSE in options for _, options in pipe.command_stack):
                pipe.execute()  # a command redis-py answers without sending it: its own path
            else:
                self._started = _SentTransaction(pipe)

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
        self._yield_to_hard_stop()
        if self._reaped(job):
            return
        super().handle_job_failure(job, queue, *args, **kwargs)

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry, execution: Execution) -> None:
        """RQ's, for a job nothing depends on (a plain gradient job; shards have their reduce job): no WATCH
        on, and no read of, the dependents set (two round trips), and the worker's IDLE state written in the
        same transaction. Other jobs take RQ's own path."""
        self._yield_to_hard_stop()
        if self._reaped(job):
            return
        if job.func_name != _JOB_FUNCTION or job.repeats_left:
            super().handle_job_success(job, queue, started_job_registry, execution)
            if isinstance(job, GradientJob):
                if not job.result_flushed:
                    job.flush_result(self.connection)  # result_ttl 0: RQ skipped _handle_success
                job.pending_result = None
            return
        with self.connection.pipeline() as pipe:
            self.increment_successful_job_count(pipeline=pipe)
            self.increment_total_working_time(job.ended_at - job.started_at, pipe)
            result_ttl = job.get_result_ttl(self.default_result_ttl)
            if result_ttl != 0:
                job._handle_success(result_ttl, pipeline=pipe, worker_name=self.name, execution_id=execution.id,
                                    execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
            if isinstance(job, GradientJob) and not job.result_flushed:
                job.flush_result(pipe)
            job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
            job._status = JobStatus.FINISHED
            self.cleanup_execution(job, pipeline=pipe, execution=execution)
            self.set_state(WorkerStatus.IDLE, pipeline=pipe)
            pipe.execute()
        if isinstance(job, GradientJob):
            job.pending_result = None
        release_slot(job)

    def _reaped(self, job: Job) -> bool:
        """Whether the job was failed (worker_lost) while this worker was cut off from Redis (a partition
        longer than its lease): then its outcome is dropped, so a client told worker_lost never sees it end a
        second time. Asked of Redis only when a lease renewal failed or lapsed: one round trip, on those jobs."""
        running = self._running
        if running is None or running.job.id != job.id:
            return False
        if not running.reaped and (running.lease_failed or
                                   time.monotonic() - running.renewed >= self.lease_s - self.heartbeat_s):
            running.reaped = not self._still_ours(running)
        if not running.reaped:
            return False
        log.warning("worker %s: job %s was reported lost while this worker was cut off from Redis; its outcome "
                    "is dropped (the job ends once, as reported)", self.name, job.id)
        pending = getattr(job, "pending_result", None)
        if pending is not None and handoff_files.is_marker(pending[1]) and handoff_files.installed() is not None:
            handoff_files.installed().delete(handoff_files.marker_ref(pending[1]))
        if isinstance(job, GradientJob):
            job.pending_result = None
        return True

    def _still_ours(self, running: _Running) -> bool:
        status, worker = self.connection.hmget(running.job.key, "status", "worker_name")
        return status == JobStatus.STARTED.value.encode() and worker == self.name.encode()

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            super().execute_job(job, queue)
        except REDIS_ERRORS as exc:
            # The job's outcome could not be recorded; its lease lapses and it is reaped as worker_lost.
            log.error("worker %s: Redis lost while finishing job %s (%s); it will be reported as worker_lost",
                      self.name, job.id, exc)
            self._wait_a_moment()
        finally:
            self._running = None
            if self._started is not None:  # the job ended without handle_execution_ended: drop the reply
                self._started.drop()
                self._started = None

    def bootstrap(self, *args, **kwargs) -> None:
        super().bootstrap(*args, **kwargs)
        if threading.current_thread() is threading.main_thread() and self._signals_r is None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._signals_r = r
        self._beating.set()
        self._beat_thread = threading.Thread(target=self._beat_loop, name="gradsvc-heartbeat", daemon=True)
        self._beat_thread.start()

    def teardown(self) -> None:
        self._beating.clear()
        try:
            super().teardown()
        except REDIS_ERRORS as exc:
            log.warning("worker %s: could not register its death, Redis unreachable (%s)", self.name, exc)

    def _beat_loop(self) -> None:
        next_beat = time.monotonic()
        while self._beating.is_set():
            try:
                self.watch()
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.heartbeat_s
                    self.beat()
            except REDIS_ERRORS as exc:
                if (running := self._running) is not None:
                    running.lease_failed = True
                log.warning("worker %s: heartbeat failed, Redis unreachable (%s); retrying", self.name, exc)
            except Exception:  # the thread must outlive any surprise, or every job would be reaped
                log.exception("worker %s: heartbeat failed", self.name)
            time.sleep(min(WATCHDOG_S, self.heartbeat_s))

    def watch(self) -> None:
        """The running job's hard deadline and cancel: past them the job is failed and the process ends."""
        at = time.monotonic()
        if self._term_at is None and self._terminated():
            self._term_at = at
        running = self._running
        if running is None:
            return
        if self._term_at is not None and at - max(self._term_at, running.started) > TERM_GRACE_S:
            self.stop_hard(running, "worker_lost", "the worker was stopped (SIGTERM/SIGINT) while the job ran "
                           f"inside one operation for over {TERM_GRACE_S:g} s; submit it again",
                           exit_code=128 + signal.SIGTERM)
        if running.overdue(at):
            self.stop_hard(running, "timeout", f"the job ran past its timeout of {running.job.timeout} s "
                           "(GRADSVC_JOB_TIMEOUT_S) inside one operation, so its worker was restarted; use a "
                           "smaller model or batch, numcheck='directional' or 'off'")
        if self.connection.exists(running.cancel_key):
            running.canceled_at = running.canceled_at or at
            if at - running.canceled_at > CANCEL_GRACE_S:
                self.stop_hard(running, "canceled", "the job was canceled by DELETE /jobs/{id} while running "
                               "inside one operation, so its worker was restarted")

    def _terminated(self) -> bool:
        """Whether SIGTERM or SIGINT arrived since the last look (the wakeup fd's bytes are signal numbers)."""
        if self._signals_r is None:
            return False
        try:
            got = os.read(self._signals_r, 512)
        except BlockingIOError:
            return False
        return signal.SIGTERM in got or signal.SIGINT in got

    def stop_hard(self, running: _Running, code: str, message: str, exit_code: int = HARD_STOP_EXIT) -> None:
        """Fails the job with `code` through RQ's failure path (status, FailedJobRegistry, the results stream
        a waiting POST reads, a shard's failure callback), unregisters this worker and ends the process: the
        op cannot be interrupted otherwise. With Redis unreachable the process ends all the same; the lapsed
        lease then reports the job worker_lost."""
        self._stopping_hard.set()
        job = running.job
        log.error("worker %s: job %s %s; failing it and exiting for the supervisor to restart this worker",
                  self.name, job.id, {"timeout": "ran past its timeout", "canceled": "was canceled"}.get(
                      code, "outlived its worker's SIGTERM"))
        try:
            job.meta["error"] = {"code": code, "message": message, "detail": {"hard_stop": True}}
            job.save_meta()
            job.ended_at = now()
            if job.failure_callback is not None:  # a shard: fail (or, canceled, settle) its job
                try:
                    job.failure_callback(job, self.connection, JobTimeoutException, None, None)
                except Exception:
                    log.exception("worker %s: failure callback of job %s failed", self.name, job.id)
            queue = Queue(job.origin, connection=self.connection, serializer=self.serializer, job_class=self.job_class)
            SimpleWorker.handle_job_failure(self, job, queue, exc_string=f"HardStop: {code}: {message}",
                                            execution=running.execution)
            self.register_death()
        except Exception:
            log.exception("worker %s: could not record the hard stop of job %s", self.name, job.id)
        finally:
            logging.shutdown()
            os._exit(exit_code)

    def _yield_to_hard_stop(self) -> None:
        """The job's own thread, back from its op while the heartbeat thread stops it hard: it records
        nothing more (the process is ending)."""
        if self._stopping_hard.is_set() and threading.current_thread() is not self._beat_thread:
            while True:
                time.sleep(60)

    def beat(self) -> None:
        """Renews this worker's lease and its running job's, then fails any job whose lease lapsed."""
        running = self._running
        if running is not None and not running.overdue(time.monotonic()) and not running.reaped:
            # A wedged job's lease lapses. After Redis was unreachable, the lease is renewed only if the job
            # was not reaped meanwhile (renewing would put a failed job back in the started registry).
            if running.lease_failed and not self._still_ours(running):
                running.reaped = True
            else:
                self.maintain_heartbeats(running.job, running.execution)
                running.renewed, running.lease_failed = time.monotonic(), False
        with self.connection.pipeline() as pipe:
            pipe.hset(self.key, "last_heartbeat", utcformat(now()))
            pipe.expire(self.key, self.lease_s)
            # Not hset's "created": the running job's heartbeat above writes last_heartbeat into a hash it
            # makes anew when Redis came back empty, and the worker then never registered again.
            pipe.sismember(worker_registration.REDIS_WORKER_KEYS, self.key)
            pipe.hexists(self.key, "queues")
            _, _, listed, registered = pipe.execute()
        if not (listed and registered):  # the hash had expired, or Redis came back empty: register again
            self._register_again()
        self.reap_abandoned()

    def _register_again(self) -> None:
        log.warning("worker %s: registering again (its key was gone from Redis)", self.name)
        with self.connection.pipeline() as pipe:
            pipe.hset(self.key, mapping={**self.serialize(), "state": self.get_state()})
            worker_registration.register(self, pipe)
            pipe.expire(self.key, self.lease_s)
            pipe.execute()

    def reap_abandoned(self) -> None:
        """RQ fails a started job whose lease lapsed (AbandonedJobError): its worker died or lost Redis."""
        for queue in self.queues:
            # LeaseRegistry: from this heartbeat thread, a reaped shard must still fail its job.
            LeaseRegistry(queue=queue, job_class=queue.job_class, serializer=queue.serializer).cleanup()

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
            log.warning("worker %s: Redis unreachable (%s); waiting for it", self.name, exc)
            self._wait_a_moment()

    def run_maintenance_tasks(self) -> None:
        try:
            super().run_maintenance_tasks()
        except REDIS_ERRORS as exc:
            log.warning("worker %s: registry maintenance skipped, Redis unreachable (%s)", self.name, exc)
            self.last_cleaned_at = now()

    def _wait_a_moment(self) -> None:
        time.sleep(1.0)


def _warm_up(device: torch.device) -> None:
    # The first matmul allocates BLAS/cuBLAS workspaces; pay that before the first job is timed.
    a = torch.randn(64, 64, device=device, requires_grad=True)
    (a @ a).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # The first shape check on the meta device loads torch's meta kernels (seconds, once per process); without
    # this the first job's prepare_ms carried it (a 2.6 s first job whose passes took 20 ms).
    warm_up_shape_check()


def redis_connection(settings: Settings) -> Redis:
    return connect(settings, socket_connect_timeout=settings.redis_timeout_s,
                   socket_timeout=max(settings.redis_timeout_s, 5.0), health_check_interval=10)


def build_worker(settings: Settings, *, index: int = 0) -> GradientWorker:
    if settings.worker_device != "cpu" and torch.cuda.is_available():
        # One worker per GPU: worker i of `gradsvc up` (or `gradsvc worker --index i`) takes GPU i mod count.
        torch.cuda.set_device(index % torch.cuda.device_count())
    ctx = make_context(settings)
    set_context(ctx)
    _warm_up(ctx.device)
    connection = redis_connection(settings)
    kind = ctx.device.type
    queues = [Queue(name, connection=connection, serializer=MsgpackSerializer, job_class=GradientJob)
              for name in keys.worker_queues(settings.queue_prefix, kind, ctx.handoff and ctx.handoff.domain)]
    name = f"gradsvc-{kind}-{socket.gethostname()}-{os.getpid()}-{index}"
    return GradientWorker(queues, connection=connection, serializer=MsgpackSerializer, job_class=GradientJob,
                          name=name, heartbeat_s=settings.worker_heartbeat_s, prefix=settings.queue_prefix)


def _wait_for_redis(settings: Settings) -> None:
    """A worker started while Redis is down waits for it rather than exiting."""
    connection = redis_connection(settings)
    delay = 0.5
    while True:
        try:
            connection.ping()
            return
        except REDIS_ERRORS as exc:
            log.warning("Redis at %s unreachable (%s); retrying in %.1f s", settings.redis_url, exc, delay)
            time.sleep(delay)
            delay = min(delay * 1.5, 5.0)
        finally:
            connection.close()


def run(settings: Settings, *, index: int = 0, burst: bool = False) -> None:
    keep_large_buffers()
    _wait_for_redis(settings)
    worker = build_worker(settings, index=index)
    from .jobs import context

    if context().device.type == "cpu":  # a CUDA context maps far more than it uses: the device's own OOM holds
        cap = cap_data(settings.max_job_bytes)
        if cap is not None:
            log.info("worker %s: memory capped at %d bytes (RLIMIT_DATA: its own plus GRADSVC_MAX_JOB_BYTES)",
                     worker.name, cap)

    port = settings.worker_metrics_port + index
    if settings.worker_metrics_port > 0:
        try:
            context().metrics.serve(port, host=settings.host)
        except OSError as exc:  # a taken port costs the metrics, not the worker (a restart would not help)
            log.error("worker %s: cannot serve metrics on %s:%d (%s); running without them; set "
                      "GRADSVC_WORKER_METRICS_PORT to a free range", worker.name, settings.host, port, exc)
    log.info("worker %s on %s, queues %s, metrics on :%d", worker.name, context().device,
             [q.name for q in worker.queues], port)
    worker.work(burst=burst, logging_level=settings.log_level.upper(), with_scheduler=False)


class _SentTransaction:
    """A pipeline's commands sent as one MULTI/EXEC on a connection of its own, the reply read later."""

    def __init__(self, pipe) -> None:
        self.pool = pipe.connection_pool
        commands = [args for args, _ in pipe.command_stack]
        self.count = len(commands)
        self.conn = self.pool.get_connection()
        try:
            self.conn.send_packed_command(self.conn.pack_commands([("MULTI",), *commands, ("EXEC",)]))
        except BaseException:
            self.drop()
            raise
        finally:
            pipe.reset()

    def settle(self) -> None:
        """Reads MULTI's OK, each command's QUEUED and EXEC's replies, as redis-py's Pipeline does; raises
        the first error among them."""
        try:
            first: Exception | None = None
            for _ in range(self.count + 1):
                try:
                    self.conn.read_response()
                except ResponseError as exc:  # a command Redis refused to queue: EXEC then aborts
                    first = first or exc
            try:
                replies = self.conn.read_response()
            except ExecAbortError:
                raise first or ResponseError("EXECABORT") from None
            if first is not None:
                raise first
            for reply in replies or ():
                if isinstance(reply, Exception):
                    raise reply
        except BaseException:
            self.conn.disconnect()  # whatever is left unread goes with it
            raise
        finally:
            self.pool.release(self.conn)

    def drop(self) -> None:
        self.conn.disconnect()
        self.pool.release(self.conn)
