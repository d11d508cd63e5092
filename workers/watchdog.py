"""The running job's hard deadline, cancel and SIGTERM, watched from the worker's heartbeat thread.

RQ's timeout (SIGALRM) and DELETE's cancel flag act only between Python steps, so a single long C++ op
outlives both; past the job's timeout + HARD_STOP_GRACE_S, or CANCEL_GRACE_S after its cancel flag
appeared, the watchdog fails the job `timeout`/`canceled` through RQ's own failure path, unregisters the
worker and ends the process (os._exit), as RQ's forking worker kills its work horse. Its supervisor
(`gradsvc up`, compose's restart policy) starts a fresh worker. SIGTERM/SIGINT are the same: Python runs
their handlers (RQ's warm shutdown) only between steps, so the watchdog sees them through the signal wakeup
fd, which the C-level handler writes even while the main thread is inside an op; a job still running
TERM_GRACE_S later fails `worker_lost` and the process ends.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from rq import Queue
from rq.executions import Execution
from rq.job import Job
from rq.timeouts import JobTimeoutException
from rq.utils import now
from rq.worker import SimpleWorker

from gradsvc.broker.record import write_error

log = logging.getLogger("gradsvc.worker")

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
class Running:
    """The job a worker runs, as its heartbeat thread watches it."""

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


class Watchdog:
    """Stops one worker's running job hard: the worker's heartbeat thread calls `watch` every WATCHDOG_S."""

    def __init__(self, worker: SimpleWorker) -> None:
        self.worker = worker
        self.stopping = threading.Event()  # failing the job and ending the process
        self.thread: threading.Thread | None = None  # the thread that watches (the worker's heartbeat thread)
        self._signals_r: int | None = None  # the read end of the signal wakeup fd
        self._term_at: float | None = None  # when SIGTERM/SIGINT was seen

    def listen_for_signals(self) -> None:
        """Installs the signal wakeup fd (from the main thread, once): SIGTERM/SIGINT then reach `watch`
        while the main thread is inside an op."""
        if threading.current_thread() is threading.main_thread() and self._signals_r is None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._signals_r = r

    def watch(self, running: Running | None) -> None:
        """The running job's hard deadline and cancel: past them the job is failed and the process ends."""
        at = time.monotonic()
        if self._term_at is None and self._terminated():
            self._term_at = at
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
        if self.worker.connection.exists(running.cancel_key):
            running.canceled_at = running.canceled_at or at
            if at - running.canceled_at > CANCEL_GRACE_S:
                self.stop_hard(running, "canceled", "the job was canceled by POST /jobs/{id}/cancel while running "
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

    def stop_hard(self, running: Running, code: str, message: str, exit_code: int = HARD_STOP_EXIT) -> None:
        """Fails the job with `code` through RQ's failure path (status, FailedJobRegistry, the results stream
        a waiting POST reads, a shard's failure callback), unregisters the worker and ends the process: the
        op cannot be interrupted otherwise. With Redis unreachable the process ends all the same; the lapsed
        lease then reports the job worker_lost."""
        self.stopping.set()
        worker, job = self.worker, running.job
        log.error("worker %s: job %s %s; failing it and exiting for the supervisor to restart this worker",
                  worker.name, job.id, {"timeout": "ran past its timeout", "canceled": "was canceled"}.get(
                      code, "outlived its worker's SIGTERM"))
        try:
            write_error(job, code, message, {"hard_stop": True})
            job.ended_at = now()
            if job.failure_callback is not None:  # a shard: fail (or, canceled, settle) its job
                try:
                    job.failure_callback(job, worker.connection, JobTimeoutException, None, None)
                except Exception:
                    log.exception("worker %s: failure callback of job %s failed", worker.name, job.id)
            queue = Queue(job.origin, connection=worker.connection, serializer=worker.serializer,
                          job_class=worker.job_class)
            SimpleWorker.handle_job_failure(worker, job, queue, exc_string=f"HardStop: {code}: {message}",
                                            execution=running.execution)
            worker.register_death()
        except Exception:
            log.exception("worker %s: could not record the hard stop of job %s", worker.name, job.id)
        finally:
            logging.shutdown()
            os._exit(exit_code)

    def yield_to_hard_stop(self) -> None:
        """The job's own thread, back from its op while the watchdog stops it hard: it records nothing more
        (the process is ending)."""
        if self.stopping.is_set() and threading.current_thread() is not self.thread:
            while True:
                time.sleep(60)
