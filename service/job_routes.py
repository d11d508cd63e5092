"""GET /jobs/{id} (the job's view) and POST /jobs/{id}/cancel."""

from __future__ import annotations

import anyio.to_thread
from litestar import Request, Response, get, post

from .api_state import ApiState
from .negotiation import respond, respond_job


@get("/jobs/{job_id:str}")
async def get_job(request: Request, owner: str, state: ApiState, job_id: str) -> Response:
    info = await state.reader.info(job_id, owner)
    return await respond_job(request, info, info.result)


@post("/jobs/{job_id:str}/cancel", status_code=200)
async def cancel_job(request: Request, owner: str, state: ApiState, job_id: str) -> Response:
    reader = state.reader
    await reader.info(job_id, owner, with_result=False)  # 404 unless it is this key's job
    await anyio.to_thread.run_sync(reader.cancel, job_id)
    return respond(request, await reader.info(job_id, owner))


ROUTES = [get_job, cancel_job]
