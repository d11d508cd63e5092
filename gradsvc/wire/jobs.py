"""A job as GET /jobs/{id} and the 202 answer show it; the release header of POST /gradients."""

from __future__ import annotations

from msgspec import Struct

from gradsvc.wire.errors import ErrorInfo
from gradsvc.wire.result import GradientResult

JOB_STATUSES = ("queued", "started", "finished", "failed", "canceled")
# POST /gradients header: the ids of finished jobs whose results the client holds, for the service to drop
# now rather than keep GRADSVC_RESULT_TTL_S (docs/api.md); at most this many a request.
RELEASE_HEADER = "Gradsvc-Release-Results"
MAX_RELEASED = 16


class Progress(Struct):
    phase: str
    done: int = 0
    total: int = 0


class JobInfo(Struct):
    """GET /jobs/{id}: the job, whatever its status, with its result once finished."""

    job_id: str
    status: str
    progress: Progress | None = None
    error: ErrorInfo | None = None
    result: GradientResult | None = None
    enqueued_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None


class JobAccepted(Struct):
    """The 202 answer: the job's status and progress as GET /jobs/{id} gives them at that moment."""

    job_id: str
    status: str
    progress: Progress | None = None
