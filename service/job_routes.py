"""GET /jobs/{id} (the job's view), POST /jobs/{id}/cancel, DELETE /jobs/{id} (the cancel's deprecated alias),
and the path's OPTIONS answer."""

from __future__ import annotations

import anyio.to_thread
from litestar import Request, Response, delete, get, post, route

from .api_state import ApiState
from .negotiation import respond, respond_job

# DELETE /jobs/{id} canceled before the cancel had its own route; kept for clients written then, outside
# /schema (a DELETE that leaves the job readable is not a delete: docs/api.md says why the cancel moved).
_DEPRECATED = {"Deprecation": "true", "Link": '</jobs/{job_id}/cancel>; rel="successor-version"'}


@route("/jobs/{job_id:str}", http_method=["OPTIONS"], include_in_schema=False)
async def job_options() -> Response:
    # Litestar's automatic OPTIONS answer for a path served by two handlers lists only the first one's
    # methods ("GET, OPTIONS"); registered first, this one replaces it.
    return Response(None, status_code=204, headers={"Allow": "DELETE, GET, OPTIONS"})


@get("/jobs/{job_id:str}")
async def get_job(request: Request, owner: str, state: ApiState, job_id: str) -> Response:
    info = await state.reader.info(job_id, owner)
    return await respond_job(request, info, info.result)


async def _cancel(request: Request, owner: str, state: ApiState, job_id: str) -> Response:
    reader = state.reader
    await reader.info(job_id, owner, with_result=False)  # 404 unless it is this key's job
    await anyio.to_thread.run_sync(reader.cancel, job_id)
    return respond(request, await reader.info(job_id, owner))


@post("/jobs/{job_id:str}/cancel", status_code=200)
async def cancel_job(request: Request, owner: str, state: ApiState, job_id: str) -> Response:
    return await _cancel(request, owner, state, job_id)


@delete("/jobs/{job_id:str}", status_code=200, include_in_schema=False)
async def cancel_job_deprecated(request: Request, owner: str, state: ApiState, job_id: str) -> Response:
    response = await _cancel(request, owner, state, job_id)
    response.headers.update({k: v.format(job_id=job_id) for k, v in _DEPRECATED.items()})
    return response


ROUTES = [job_options, get_job, cancel_job, cancel_job_deprecated]
