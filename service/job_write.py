"""A plain gradient job's commands for its queue, as RQ writes them, built without RQ per request.

RQ's enqueue into a pipeline (Job.create, Job.to_dict, the queue's own checks) was a quarter of the API's
Python on a tiny job's way (bench/profile_api.py), and it writes the same commands for every such job but
for the job's id, its two timestamps, its data (the body and its format) and its meta (the owner).
JobTemplate has RQ enqueue a probe job once, keeps RQ's commands, and fills those fields in per job. It is
kept only if, filled in for a second probe (another id, body, format and owner), it gives back exactly what
RQ wrote for that one: an RQ that writes anything else per job makes no template, and the enqueue goes
through RQ as before. tests/service/test_job_write.py pins the record against RQ's own."""

from __future__ import annotations

from rq import Queue
from rq.utils import now, utcformat

from gradsvc.broker.job import GRADIENT_JOB, MsgpackSerializer
from gradsvc.broker.record import JobMeta

# Two probe jobs (id, body, format, owner): the template is made of RQ's enqueue of the first, checked against
# its enqueue of the second.
_PROBES = (("00000000-0000-4000-8000-0000005e1f00", b"<probe body>", "json", "<probe owner>"),
           ("00000000-0000-4000-8000-0000005e1f01", b"\x81\xa1b\xc0", "msgpack", "<another owner>"))
_STAMPS = frozenset({"created_at", "enqueued_at"})


def job_data(body: bytes | str, fmt: str) -> bytes:
    """RQ's `data` of a gradient job (Job.data: its function, instance and arguments, serialized)."""
    return MsgpackSerializer.dumps((GRADIENT_JOB, None, (body, fmt), {}))


def job_meta(owner: str) -> bytes:
    """RQ's `meta` field of a plain job of `owner` (Job._serialize_meta)."""
    return MsgpackSerializer.dumps(JobMeta(owner=owner).as_meta())


class JobTemplate:
    """RQ's commands for a plain job in one queue, with the per-job fields as slots (`commands`)."""

    def __init__(self, slotted: list[tuple[list, list[tuple[int, object]]]]) -> None:
        self._slotted = slotted  # each command: its arguments, and (index, slot) for those filled in per job

    @classmethod
    def of(cls, queue: Queue, timeout_s: int, result_ttl_s: int, failure_ttl_s: int) -> JobTemplate | None:
        """The template of `queue`'s jobs with these TTLs, made of RQ's enqueue of one probe job and checked
        against its enqueue of another; None when RQ writes something per job it does not fill in."""
        first, second = (_written(queue, (timeout_s, result_ttl_s, failure_ttl_s), *probe) for probe in _PROBES)
        template = cls([_slotted(args, *_PROBES[0]) for args in first])
        again = template.commands(*_PROBES[1], stamp="<stamp>")
        return template if again == [_plain(args, "<stamp>") for args in second] else None

    def commands(self, job_id: str, body: bytes | str, fmt: str, owner: str, stamp: str | None = None) -> list[tuple]:
        """The job's commands (RQ's, in RQ's order). `stamp`: its created_at and enqueued_at (default: now)."""
        values = {_ID: job_id, _DATA: job_data(body, fmt), _META: job_meta(owner), _STAMP: stamp or utcformat(now())}
        out = []
        for args, slots in self._slotted:
            if slots:
                args = args.copy()
                for i, slot in slots:
                    args[i] = values[slot] if type(slot) is _Slot else slot(job_id)
            out.append(tuple(args))
        return out


class _Slot:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_ID, _DATA, _META, _STAMP = _Slot("id"), _Slot("data"), _Slot("meta"), _Slot("stamp")


def _plain(args: tuple, stamp: str | None = None) -> tuple:
    """A command as the packer sends it: enums (RQ's JobStatus) as their values; `stamp`: an HSET's
    timestamps all made that one."""
    out = [getattr(a, "value", a) if not isinstance(a, (bytes, int, float)) else a for a in args]
    if stamp is not None and out[0] == "HSET":
        for i in range(3, len(out), 2):
            if out[i - 1] in _STAMPS:
                out[i] = stamp
    return tuple(out)


def _written(queue: Queue, ttls: tuple[int, int, int], job_id: str, body: bytes, fmt: str,
             owner: str) -> list[tuple]:
    """RQ's commands for one job, recorded in a pipeline never executed. `ttls`: its timeout, result and failure TTLs."""
    timeout_s, result_ttl_s, failure_ttl_s = ttls
    pipe = queue.connection.pipeline()
    queue.enqueue(GRADIENT_JOB, body, fmt, job_id=job_id, job_timeout=timeout_s, result_ttl=result_ttl_s,
                  failure_ttl=failure_ttl_s, meta=JobMeta(owner=owner).as_meta(), description="gradients",
                  pipeline=pipe)
    written = [tuple(args) for args, _ in pipe.command_stack]
    pipe.reset()
    return written


def _slotted(args: tuple, job_id: str, body: bytes, fmt: str, owner: str) -> tuple[list, list[tuple[int, object]]]:
    """One of RQ's commands for the probe job (job_id, body, fmt, owner) with its per-job arguments made slots:
    the id (in keys, or alone), the HSET's timestamps, data and meta."""
    plain = list(_plain(args))
    data, meta, slots = job_data(body, fmt), job_meta(owner), []
    for i, arg in enumerate(plain):
        if i == 0:
            continue
        if arg == job_id:
            slots.append((i, _ID))
        elif isinstance(arg, str) and job_id in arg:
            prefix, suffix = arg.split(job_id, 1)
            slots.append((i, lambda new_id, p=prefix, s=suffix: f"{p}{new_id}{s}"))
        elif plain[0] == "HSET" and i >= 3 and i % 2 == 1 and plain[i - 1] in _STAMPS:
            slots.append((i, _STAMP))
        elif arg == data:
            slots.append((i, _DATA))
        elif arg == meta:
            slots.append((i, _META))
    return plain, slots
