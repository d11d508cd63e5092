"""POST /gradients (validate, enqueue, wait for the result) and POST /estimate (predicted memory): each reads
the HTTP bits and maps its part's outcome (service/submission.py) to a response."""

from __future__ import annotations

from litestar import Request, Response, post

from gradsvc.wire import JobAccepted

from .api_state import ApiState
from .error_responses import error_response
from .job_reader import JobReader
from .negotiation import MSGPACK, Encoded, respond, respond_job, wants_msgpack
from .parsing import idempotency_key, key_age_s, read_request, released_results, wait_s
from .submission import Outcome, Submission


@post("/gradients", status_code=200)
async def submit_gradients(request: Request, owner: str, state: ApiState) -> Response:
    wait, released, key = wait_s(request, state.settings), released_results(request), idempotency_key(request)
    asked = Submission(owner, wait, released, key, key_age_s(request) if key is not None else None)
    return await _answer(request, await state.submitter.submit(asked, read_request(request)))


async def _answer(request: Request, outcome: Outcome) -> Response:
    """The result (200), the job's error (its code's status), or the job as it is now (202)."""
    info, job_id = outcome.info, outcome.job_id
    if outcome.stored is not None:
        if wants_msgpack(request):  # the stored MessagePack is the answer: no decode, no copy
            return Encoded(outcome.stored, media_type=MSGPACK)
        result = JobReader.decode_result(outcome.stored)
        return await respond_job(request, result, result, encoding=outcome.encoding)
    if not outcome.accepted and info.status == "finished":
        return await respond_job(request, info.result, info.result, encoding=outcome.encoding)
    if not outcome.accepted and info.error is not None:
        return error_response(request, info.error.code, info.error.message, info.error.detail,
                              job_id=job_id, status=info.status)
    return respond(request, JobAccepted(job_id=job_id, status=info.status, progress=info.progress), status=202,
                   headers={"Location": f"/jobs/{job_id}"})


@post("/estimate", status_code=200)
async def estimate_memory(request: Request, owner: str, state: ApiState) -> Response:
    body, _, req = await read_request(request)
    return respond(request, await state.submitter.estimate(req, body, owner))


ROUTES = [submit_gradients, estimate_memory]
