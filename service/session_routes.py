"""POST /sessions, GET and DELETE /sessions/{id}, POST /sessions/{id}/step, /forward_backward, /forward and
/optim_step, GET /sessions/{id}/weights: each reads the HTTP bits and maps its part's outcome
(service/training_sessions.py) to a response. Another key's session is a 404, as another key's job is."""

from __future__ import annotations

import anyio.to_thread
import msgspec
from litestar import Request, Response, delete, get, post, route

from gradsvc.wire import (GradientRequest, JobAccepted, SessionBatch, SessionCreate, SessionOptimStep, SessionStepResult,
                          Tensor)

from .api_state import ApiState
from .exceptions import ServiceError
from .messages import explain
from .negotiation import MSGPACK, Encoded, body_format, respond, tensors_for_json, tree_for_json, wants_msgpack
from .parsing import check_integers, check_seeds, idempotency_key, wait_s, with_integral_floats
from .training_sessions import Operation

SAFETENSORS = "application/octet-stream"
_answers = msgspec.msgpack.Decoder(SessionStepResult)
_weights = msgspec.msgpack.Decoder(dict[str, Tensor])


async def read_body(request: Request, kind: type):
    """(the body's bytes, its format, the body decoded as `kind`); a fault is a coded 400. Integer fields sent
    as 2.0 (JSON Schema integers) are taken, and the body re-encoded with them as ints for the worker's decode."""
    fmt = body_format(request)
    body = await request.body()
    if not body:
        raise ServiceError("malformed_body", "the request body is empty; send the JSON object docs/sessions.md shows")
    try:
        decoded = (msgspec.msgpack if fmt == "msgpack" else msgspec.json).decode(body, type=kind)
    except msgspec.ValidationError as exc:
        fixed = with_integral_floats(body, fmt, exc, kind)  # integers written as 2.0: re-encoded for the worker
        if fixed is None:
            message, detail = explain(exc, kind)
            raise ServiceError("invalid_body", message, reason=str(exc), **detail) from None
        decoded, body = fixed
    except msgspec.DecodeError as exc:
        raise ServiceError("malformed_body", f"the body is not valid {fmt}: {exc}", reason=str(exc)) from None
    if len(body) > 1 << 20:  # a large graph's walk takes milliseconds: off the event loop
        await anyio.to_thread.run_sync(check_integers, decoded)
    else:
        check_integers(decoded)  # what Redis and the queue hold of an integer: 64 bits
    if isinstance(decoded, SessionCreate):
        check_seeds(GradientRequest(model=decoded.model, inputs=[]))
    return body, fmt, decoded


@post("/sessions", status_code=201)
async def create_session(request: Request, owner: str, state: ApiState) -> Response:
    body, fmt, create = await read_body(request, SessionCreate)
    created = await state.training.create(owner, create, body, fmt, wait_s(request, state.settings),
                                          idempotency_key(request))
    return respond(request, created, status=201, headers={"Location": f"/sessions/{created.session_id}"})


async def _operate(request: Request, owner: str, state: ApiState, session_id: str, op: str) -> Response:
    body, fmt, call = await read_body(request, SessionOptimStep if op == "optim_step" else SessionBatch)
    answer = await state.training.operate(owner, Operation(session_id, op, body, fmt, key=idempotency_key(request)),
                                          wait_s(request, state.settings), call)
    if answer.data is None:  # still running: the same call with the same idempotency key answers once it ended
        return respond(request, JobAccepted(job_id=answer.job_id, status="started"), status=202)
    if wants_msgpack(request):
        return Encoded(answer.data, media_type=MSGPACK)
    encoding = call.options.encoding if op != "optim_step" else "auto"
    return respond(request, for_json(_answers.decode(answer.data), encoding))


def for_json(r: SessionStepResult, encoding: str) -> SessionStepResult:
    return msgspec.structs.replace(r, gradients=tensors_for_json(r.gradients, encoding),
                                   logprobs=tensors_for_json(r.logprobs, encoding),
                                   weights=tensors_for_json(r.weights, encoding),
                                   buffers=tensors_for_json(r.buffers, encoding),
                                   outputs=tree_for_json(r.outputs, encoding))


@post("/sessions/{session_id:str}/step", status_code=200)
async def session_step(request: Request, owner: str, state: ApiState, session_id: str) -> Response:
    return await _operate(request, owner, state, session_id, "step")


@post("/sessions/{session_id:str}/forward_backward", status_code=200)
async def session_forward_backward(request: Request, owner: str, state: ApiState, session_id: str) -> Response:
    return await _operate(request, owner, state, session_id, "forward_backward")


@post("/sessions/{session_id:str}/forward", status_code=200)
async def session_forward(request: Request, owner: str, state: ApiState, session_id: str) -> Response:
    return await _operate(request, owner, state, session_id, "forward")


@post("/sessions/{session_id:str}/optim_step", status_code=200)
async def session_optim_step(request: Request, owner: str, state: ApiState, session_id: str) -> Response:
    return await _operate(request, owner, state, session_id, "optim_step")


@get("/sessions/{session_id:str}/weights")
async def session_weights(request: Request, owner: str, state: ApiState, session_id: str) -> Response:
    raw = SAFETENSORS in request.headers.get("accept", "")
    answer = await state.training.operate(owner, Operation(session_id, "weights", b"", "safetensors" if raw else
                                                           "msgpack"), state.settings.max_wait_s)
    if answer.data is None:
        raise ServiceError("queue_unavailable", f"the worker holding session {session_id} did not answer within "
                           f"GRADSVC_MAX_WAIT_S={state.settings.max_wait_s:g}; retry", headers={"Retry-After": "5"})
    if raw:
        return Encoded(answer.data, media_type=SAFETENSORS)
    if wants_msgpack(request):
        return Encoded(answer.data, media_type=MSGPACK)
    return respond(request, tensors_for_json(_weights.decode(answer.data), "auto"))


@route("/sessions/{session_id:str}", http_method=["OPTIONS"], include_in_schema=False)
async def session_options() -> Response:
    # Litestar's own OPTIONS answer for a path served by two handlers lists only the first one's methods.
    return Response(None, status_code=204, headers={"Allow": "DELETE, GET, OPTIONS"})


@get("/sessions/{session_id:str}")
async def get_session(request: Request, owner: str, state: ApiState, session_id: str) -> Response:
    return respond(request, await state.training.info(owner, session_id))


@delete("/sessions/{session_id:str}", status_code=200)
async def delete_session(request: Request, owner: str, state: ApiState, session_id: str) -> Response:
    await state.training.delete(owner, session_id)
    return respond(request, {"deleted": session_id})


ROUTES = [create_session, session_step, session_forward_backward, session_forward, session_optim_step, session_weights,
          session_options,
          get_session, delete_session]
