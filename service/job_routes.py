"""GET /jobs/{id} (the job's view), DELETE /jobs/{id} (cancel), and the path's OPTIONS answer."""

from __future__ import annotations

import anyio.to_thread
from litestar import Request, Response, delete, get, route

from .api_state import ApiState
from .negotiation import respond, respond_job


@route("/jobs/{job_id:str}", http_method=["OPTIONS"], include_in_schema=False)
async def job_options() -> Response:
    # Litestar's automatic OPTIONS answer for a path served by two handlers lists only the first one's
    # methods ("GET, OPTIONS"); registered first, this one replaces it.
    return Response(None, status_code=204, headers={"Allow": "DELETE, GET, OPTIONS"})


@get("/jobs/{job_id:str}")
async def get_job(request: Request, owner: str, state: ApiState, job_id: str) -> Response:
    info = await state.reader.info(job_id, owner)
    return await respond_job(request, info, info.result)


@delete("/jobs/{job_id:str}", status_code=200)
async def cancel_job(request: Request, owner: str, state: ApiState, job_id: str) -> Response:
    reader = state.reader
    await reader.info(job_id, owner, with_result=False)  # 404 unless it is this key's job
    await anyio.to_thread.run_sync(reader.cancel, job_id)
    return respond(request, await reader.info(job_id, owner))


ROUTES = [job_options, get_job, cancel_job]
