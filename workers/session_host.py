"""The training sessions one worker holds (docs/sessions.md): each session's TrainingSession on the worker's
device, at most GRADSVC_SESSION_MAX_PER_WORKER of them; a session this worker does not hold, or holds at another
step than its record says (another worker stepped it since), is rebuilt from its last checkpoint; checkpoints
every `checkpoint_every` optimizer steps, and of every held session on a graceful stop."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from gradsvc.broker.session_records import COMMITTED, SessionRecord, SessionRecords
from gradsvc.engine import ComputeError, session_state
from gradsvc.engine.frozen import FrozenStore
from gradsvc.engine.session import TrainingSession

log = logging.getLogger("gradsvc.worker")

# checkpoint_every's default: one checkpoint per this many bytes of state, so a step writes about this much on
# average (16 MiB: a few milliseconds into a local Redis), every step for a state under it, at most every
# CHECKPOINT_EVERY_MAX steps (a lost worker costs at most that many steps to replay).
CHECKPOINT_BYTES_PER_STEP = 16 << 20
CHECKPOINT_EVERY_MAX = 100


def default_checkpoint_every(state_bytes: int) -> int:
    return max(1, min(CHECKPOINT_EVERY_MAX, math.ceil(state_bytes / CHECKPOINT_BYTES_PER_STEP)))


class SessionHost:
    """session id -> (its TrainingSession, its owner), on this worker."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self.sessions: dict[str, TrainingSession] = {}
        self.frozen = FrozenStore()  # the frozen weights its sessions share, each held once
        self.steps_total = 0

    @property
    def held_bytes(self) -> int:
        """What its sessions hold: each one's own state, and the frozen weights they share once."""
        return sum(s.state_bytes for s in self.sessions.values()) + self.frozen.held_bytes

    def room_for(self, session_id: str, records: SessionRecords) -> None:
        """Makes room for one more session: sessions whose record expired or moved to another worker go first;
        a worker still full refuses with workers_full (503)."""
        if session_id in self.sessions or len(self.sessions) < self.max_sessions:
            return
        self.sweep(records)
        if len(self.sessions) >= self.max_sessions:
            raise ComputeError("workers_full", f"this worker holds GRADSVC_SESSION_MAX_PER_WORKER="
                               f"{self.max_sessions} training sessions already; delete sessions you no longer use "
                               "(DELETE /sessions/{id}), start more workers, or raise the setting",
                               limit=self.max_sessions)

    def sweep(self, records: SessionRecords) -> int:
        """Drops the sessions whose record is gone (deleted, expired) or names another holder (and not this worker
        among its members): a worker's memory
        holds only live sessions, whether or not another one comes. Answers how many were dropped."""
        ids = list(self.sessions)
        if not ids:
            return 0
        gone = [i for i, rec in zip(ids, records.many(ids))
                if rec is None or rec.holder != records.worker and records.worker not in rec.members]
        for session_id in gone:
            self.sessions.pop(session_id, None)
        return len(gone)

    def held(self, session_id: str, rec: SessionRecord, records: SessionRecords,
             reopen: Callable[[], TrainingSession]) -> tuple[TrainingSession, int | None]:
        """(the session as its record says it stands, the checkpoint's step when it was restored from it: the
        steps after it are lost and the answer says so). `reopen` builds its model again, for the checkpoint."""
        session = self.sessions.get(session_id)
        if session is not None and rec.holder == records.worker and (session.step, session.accumulated) == \
                (rec.step, rec.accumulated):
            return session, None
        return self.restore(session_id, records, reopen)

    def restore(self, session_id: str, records: SessionRecords,
                reopen: Callable[[], TrainingSession]) -> tuple[TrainingSession, int]:
        """The session rebuilt here from its last checkpoint (`reopen` builds its model), and the checkpoint's
        step."""
        self.sessions.pop(session_id, None)
        self.room_for(session_id, records)
        data = records.state(session_id)
        if data is None:
            raise ComputeError("session_lost", f"session {session_id}'s checkpoint is gone (expired, or Redis lost "
                               "it): its state cannot be rebuilt; create a new session from your last weights",
                               session_id=session_id)
        started = time.perf_counter()
        session = reopen()
        session.restore(*session_state.from_bytes(data))
        log.info("session %s restored from its checkpoint at step %d in %.3f s", session_id, session.step,
                 time.perf_counter() - started)
        self.sessions[session_id] = session
        return session, session.step


    def checkpoint_all(self, records: SessionRecords) -> int:
        """On a graceful stop: every session this worker holds and still owns, checkpointed where it stands.
        Returns how many were written."""
        written = 0
        for session_id, session in list(self.sessions.items()):
            rec, read = records.read(session_id)
            if rec is None or rec.holder != records.worker or rec.checkpoint_step == session.step and \
                    not session.accumulated:
                continue
            rec.checkpoint_step = session.step
            if records.commit(session_id, read, rec, session_state.to_bytes(*session.state())) == COMMITTED:
                written += 1
        self.sessions.clear()
        return written


# How often an idle worker looks for the training sessions it holds that are deleted, expired or held elsewhere
# (or every half GRADSVC_SESSION_IDLE_TTL_S, when that is shorter).
SESSION_SWEEP_S = 30.0


class SessionSweep:
    """The worker's idle chore (its heartbeat thread calls it while no job runs): every SESSION_SWEEP_S the
    sessions whose record is gone or names another holder are dropped (SessionHost.sweep), then `then` runs (the
    free heap handed back to the system)."""

    def __init__(self, ctx, connection, worker: str, then: Callable[[], object]) -> None:
        s = ctx.settings
        self.ctx, self.then = ctx, then
        self.records = SessionRecords(connection, s.queue_prefix, s.session_idle_ttl_s, worker)
        self.every_s = min(SESSION_SWEEP_S, s.session_idle_ttl_s / 2)
        self.swept = time.monotonic()

    def __call__(self) -> None:
        host = self.ctx.sessions
        if host.sessions and time.monotonic() - self.swept >= self.every_s:
            self.swept = time.monotonic()
            dropped = host.sweep(self.records)
            if dropped:
                log.info("worker %s: dropped %d training session(s) deleted, expired or held elsewhere",
                         self.records.worker, dropped)
                self.ctx.metrics.sessions_held.set(len(host.sessions))
                self.ctx.metrics.session_bytes.set(host.held_bytes)
        self.then()
