"""POST /gradients (validate, enqueue, wait for the result) and POST /estimate (predicted memory)."""

from __future__ import annotations

import asyncio

import anyio.to_thread
from litestar import Request, Response, post

from gradsvc.wire import JobAccepted

from .api_state import ApiState
from .error_responses import error_response
from .negotiation import MSGPACK, Encoded, respond, respond_job, wants_msgpack
from .parsing import idempotency_key, key_age_s, read_request, released_results, wait_s
from .submission import small_layer_spec


@post("/gradients", status_code=200)
async def submit_gradients(request: Request, owner: str, state: ApiState) -> Response:
    submitter, reader = state.submitter, state.reader
    wait = wait_s(request, state.settings)
    released = released_results(request)
    # Results the client holds are dropped while its body comes in (a thread: Redis, then their files).
    releasing = asyncio.ensure_future(anyio.to_thread.run_sync(reader.release, released, owner)) if released else None
    try:
        body, fmt, req = await read_request(request)
    finally:
        recycled = False
        if releasing is not None:
            count, recycled = await releasing
            state.metrics.results_released.inc(count)
    key = idempotency_key(request)
    age_s = key_age_s(request) if key is not None else None
    prep = submitter.prepare_inline(req, body, key)
    if submitter.on_event_loop(prep):
        # A small layer-spec request that needs nothing else of Redis: checked on the event loop (a
        # spec seen before costs ~0.1 ms) and enqueued over the async connection, with no thread hop.
        job_id, created = await submitter.enqueue_async(body, fmt, owner), True
    else:
        job_id, created = await anyio.to_thread.run_sync(lambda: submitter.enqueue(req, body, fmt, owner, key,
                                                                                   prep, age_s, recycled))
    if created:
        state.metrics.jobs_submitted.inc()
        if wait == 0:  # plain async: 202 with the job as it is now, even one a worker has finished already
            info = await reader.info(job_id, owner, with_result=False)
            return respond(request, JobAccepted(job_id=job_id, status=info.status, progress=info.progress),
                           status=202, headers={"Location": f"/jobs/{job_id}"})
    ended, raw = await reader.wait(job_id, wait)
    if ended and raw is not None:  # finished
        if wants_msgpack(request):  # the stored MessagePack is the answer: no decode, no copy
            return Encoded(raw, media_type=MSGPACK)
        result = reader.decode_result(raw)
        return await respond_job(request, result, result, encoding=req.options.encoding)
    # Failed, or still running: the answer is what GET /jobs/{id} says now (it may have ended meanwhile).
    info = await reader.info(job_id, owner)
    if info.status == "finished":
        return await respond_job(request, info.result, info.result, encoding=req.options.encoding)
    if info.error is not None:
        return error_response(request, info.error.code, info.error.message, info.error.detail,
                              job_id=job_id, status=info.status)
    return respond(request, JobAccepted(job_id=job_id, status=info.status, progress=info.progress), status=202,
                   headers={"Location": f"/jobs/{job_id}"})


@post("/estimate", status_code=200)
async def estimate_memory(request: Request, owner: str, state: ApiState) -> Response:
    engine, graphs, blobs = state.engine, state.graphs, state.blobs
    body, _, req = await read_request(request)
    if small_layer_spec(req, body):
        result = engine.estimate(req)  # as for POST /gradients: a spec seen before is a look-up (~0.1 ms)
    else:
        def checked_estimate():
            blobs.check(owner, req)
            return engine.estimate(req, graphs=graphs.resolver(owner))

        result = await anyio.to_thread.run_sync(checked_estimate)
    return respond(request, result)


ROUTES = [submit_gradients, estimate_memory]
