"""Leases: a worker renews its jobs' leases every heartbeat; a job (or worker) silent for
LEASE_HEARTBEATS heartbeats is lost, and the registry's cleanup fails it."""

from __future__ import annotations

from rq.registry import StartedJobRegistry
from rq.timeouts import TimerDeathPenalty

LEASE_HEARTBEATS = 3


def lease_s(heartbeat_s: float) -> int:
    return int(LEASE_HEARTBEATS * heartbeat_s)


class LeaseRegistry(StartedJobRegistry):
    """RQ's StartedJobRegistry, whose cleanup (failing abandoned jobs) may run outside the main thread: RQ
    runs failure callbacks under a SIGALRM timeout, which only the main thread may set, so a shard reaped
    from a heartbeat thread would never fail its job. A timer thread enforces the timeout instead."""

    death_penalty_class = TimerDeathPenalty
