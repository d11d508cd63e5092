"""A session held by several workers (docs/sessions.md, "A session over several workers"), the worker's side. The
API sends each call to every member's own queue in one transaction (so two sessions' calls reach every worker in
the same order and no two members wait on each other crosswise), each job with the members, its rank and the call's
id (rank 0's job id).

At the start of a call every member writes to Redis what it holds, its replica's formation and step or "none", and
reads every member's (report): all the same, the members go on with the process group and replicas they hold;
else every member drops its own and the call forms a new group (its id the formation's): rank 0 serves a TCPStore,
its address through Redis, the others connect, and each builds a gloo process group over it (torch's collective),
then restores the replica from the session's checkpoint. Every member decides from the same reports, so all go on
or all rebuild. Each wait (the reports, the rendezvous, every collective) is bounded by
GRADSVC_SESSION_COLLECTIVE_TIMEOUT_S: past it, or when a member dies (its sockets close), the call fails
member_lost, and the API's next call forms the group again from the members alive."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from gradsvc.broker import affinity, keys
from gradsvc.engine import ComputeError
from gradsvc.engine.replicas import Group
from gradsvc.engine.session import TrainingSession

REPORT_TTL_S = 600
LOOK_S = 0.5  # how often a member waiting for the others' reports looks whether the missing ones are alive
NONE = "none"


@dataclass(frozen=True)
class Membership:
    """A group job's part: the session's members (rank 0 first), this job's rank, the call's id."""

    members: tuple[str, ...]
    rank: int
    call: str

    @classmethod
    def of(cls, raw: dict | None) -> "Membership | None":
        if not raw:
            return None
        return cls(tuple(raw["members"]), int(raw["rank"]), str(raw["call"]))

    @property
    def size(self) -> int:
        return len(self.members)


def check_member(worker: str, m: Membership) -> None:
    """A member's job taken by another worker (the mover queued it on the shared queue: its member is gone)."""
    if m.members[m.rank] != worker:
        raise ComputeError("member_lost", f"worker {m.members[m.rank]}, rank {m.rank} of the session's {m.size}, is "
                           "gone; the call was not applied: send it again (the session is formed again from the "
                           "workers alive)", rank=m.rank)


def holding(session: TrainingSession | None, m: Membership, at: tuple[int, int]) -> str:
    """What this member reports: its group's formation and its replica's step, or NONE (no replica, another
    group, or a replica not where the record stands, `at`)."""
    if session is None or session.group is None or session.group.size != m.size or session.group.rank != m.rank \
            or (session.step, session.accumulated) != at:
        return NONE
    return f"{session.group.formation}:{session.step}:{session.accumulated}"


def reports(redis, prefix: str, session_id: str, m: Membership, mine: str, timeout_s: float) -> list[str]:
    """Writes this member's report and answers every member's, once all are in (polling Redis)."""
    redis.set(keys.training_session_report_key(prefix, session_id, m.call, m.rank), mine, ex=REPORT_TTL_S)
    names = [keys.training_session_report_key(prefix, session_id, m.call, r) for r in range(m.size)]
    started = time.monotonic()
    looked, pause = started, 0.001
    while True:
        found = redis.mget(names)
        if all(v is not None for v in found):
            return [v.decode() if isinstance(v, bytes) else v for v in found]
        missing = [m.members[r] for r, v in enumerate(found) if v is None]
        now = time.monotonic()
        gone = [w for w in missing if now - looked > LOOK_S and not affinity.worker_alive(redis, w)]
        if gone or now - started > timeout_s:
            looked = now
            why = "are gone" if gone else \
                f"did not start it within GRADSVC_SESSION_COLLECTIVE_TIMEOUT_S={timeout_s:g} " \
                "(busy with a longer job)"
            raise ComputeError("member_lost", f"the session's workers {gone or missing} {why}; this call was not "
                               "applied: send it again (the session is formed again from the workers alive)",
                               missing=gone or missing)
        if now - looked > LOOK_S:
            looked = now
        time.sleep(pause)
        pause = min(0.02, pause * 2)


def goes_on(all_reports: list[str]) -> bool:
    return all_reports[0] != NONE and len(set(all_reports)) == 1


def form(redis, prefix: str, session_id: str, m: Membership, address: str, timeout_s: float) -> Group:
    """A new process group of the members, formation m.call: rank 0 serves the store, its address through Redis."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    key = keys.training_session_rendezvous_key(prefix, session_id, m.call)
    try:
        if m.rank == 0:
            store = dist.TCPStore(address, 0, None, True, timeout=timeout, wait_for_workers=False)
            redis.set(key, f"{address}:{store.port}", ex=REPORT_TTL_S)
        else:
            host, port = _rendezvous_address(redis, key, timeout_s).rsplit(":", 1)
            store = dist.TCPStore(host, int(port), None, False, timeout=timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{session_id}/{m.call}", store), m.rank, m.size, opts)
    except RuntimeError as exc:  # a member gone, or past the timeout
        raise ComputeError("member_lost", f"the session's workers did not all join its process group "
                           f"({str(exc).splitlines()[0][:200]}); the call was not applied: send it again") from None
    return Group(pg=pg, store=store, rank=m.rank, size=m.size, formation=m.call)


def _rendezvous_address(redis, key: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        value = redis.get(key)
        if value is not None:
            return value.decode() if isinstance(value, bytes) else value
        if time.monotonic() > deadline:
            raise ComputeError("member_lost", "rank 0 of the session did not serve its rendezvous within "
                               f"GRADSVC_SESSION_COLLECTIVE_TIMEOUT_S={timeout_s:g}; send the call again")
        time.sleep(0.005)
