"""The one renderer every error goes through: a ServiceError (service/exceptions.py), an engine error,
Litestar's own HTTP exceptions and a Redis outage all answer the same body, with their code's status."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gradsvc.broker.blobs import BlobError
from gradsvc.broker.connection import refusal
from gradsvc.engine import EngineError
from gradsvc.wire import ErrorBody, ErrorInfo

from .exceptions import ServiceError, status_for
from .negotiation import respond
from .parsing import wait_message

log = logging.getLogger("gradsvc.api")

_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
               413: "body_too_large", 415: "unsupported_media_type", 429: "rate_limited"}


def error_response(request: Request, code: str, message: str, detail: dict | None = None,
                   headers: dict[str, str] | None = None, **extra: Any) -> Response:
    body = ErrorBody(error=ErrorInfo(code=code, message=message, detail=detail or {}), **extra)
    return respond(request, body, status=status_for(code), headers=headers)


def handle_exception(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ServiceError):
        return error_response(request, exc.code, exc.message, exc.detail, exc.headers)
    if isinstance(exc, (EngineError, BlobError)):  # a spec the engine refused, a tensor ref Redis lacks
        return error_response(request, exc.code, exc.message, exc.detail)
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return error_response(request, "queue_unavailable", "the job queue (Redis) is unreachable "
                              f"({type(exc).__name__}); retry in a few seconds, or ask the operator to check "
                              "GRADSVC_REDIS_URL", headers={"Retry-After": "2"})
    code = refusal(exc)
    if code is not None:
        return _refused(request, code, exc)
    if isinstance(exc, ValidationException):
        return _parameter_error(request, exc)
    if isinstance(exc, HTTPException):
        return _framework_error(request, exc)
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request, "internal_error", f"unexpected {type(exc).__name__}; this is a gradsvc bug")


_REFUSED = {
    "redis_oom": "Redis is at its memory limit (maxmemory) and refuses writes; retry after Retry-After, release "
                 "results you hold (Gradsvc-Release-Results) or ask the operator to raise maxmemory or free memory",
    "redis_readonly": "Redis is read-only (a replica: a failover is in progress or demoted the server "
                      "GRADSVC_REDIS_URL names); retry after Retry-After, or ask the operator to point the service "
                      "at the new master (GRADSVC_REDIS_SENTINELS follows one)",
    "redis_unavailable": "Redis refuses writes (its snapshots fail, it lacks its replicas, or its master is down); "
                         "retry after Retry-After, or ask the operator to check the Redis log",
}
REFUSED_RETRY_S = 5


def _refused(request: Request, code: str, exc: Exception) -> Response:
    """Redis answering but refusing writes: a 503 saying which refusal, counted (gradsvc_redis_refusals_total)."""
    request.app.state.metrics.redis_refusals.labels(code).inc()
    log.warning("%s %s: Redis refused a write (%s)", request.method, request.url.path, str(exc)[:200])
    return error_response(request, code, _REFUSED[code], {"reply": str(exc)[:200]},
                          headers={"Retry-After": str(REFUSED_RETRY_S)})


def _parameter_error(request: Request, exc: ValidationException) -> Response:
    """Litestar's query/path parameter validation, without its Python reprs."""
    problems = exc.extra if isinstance(exc.extra, list) else []
    for problem in problems:
        if not isinstance(problem, dict):
            continue
        name = str(problem.get("key", "?"))
        source = getattr(problem.get("source"), "value", problem.get("source")) or "query"
        given = request.query_params.get(name) if source == "query" else request.path_params.get(name)
        if name == "wait":
            message = wait_message(given, request.app.state.settings.max_wait_s)
        else:
            message = f"{source} parameter `{name}`: {str(problem.get('message', 'invalid value')).replace('`', '')}"
            message += f", got {given!r}; see docs/api.md for the parameters of {request.method} {request.url.path}"
        return error_response(request, "invalid_parameter", message, {"parameter": name, "in": source,
                                                                      "value": given})
    return error_response(request, "invalid_parameter", f"invalid parameters for {request.method} "
                          f"{request.url.path}; see docs/api.md")


def _routes(request: Request) -> str:
    seen: dict[str, list[str]] = {}
    for route in request.app.routes:
        methods = sorted(m for m in getattr(route, "methods", ()) if m not in ("HEAD", "OPTIONS"))
        path = route.path.replace(":str}", "}")
        if methods:
            seen.setdefault(path, []).extend(m for m in methods if m not in seen.get(path, []))
    return ", ".join(f"{'|'.join(ms)} {p}" for p, ms in seen.items())


def _framework_error(request: Request, exc: HTTPException) -> Response:
    """Litestar's own exceptions (size limit, unknown route, method) in the same body, with a way out."""
    status = exc.status_code
    method, path = request.method, request.url.path
    headers = dict(exc.headers or {})
    if status == 413:
        limit = request.app.state.settings.max_body_bytes
        code = "body_too_large"
        size = f"{limit / 2**20:g} MiB" if limit >= 2**20 else f"{limit / 2**10:g} KiB"
        message = (f"the request body is larger than the limit of {limit} bytes ({size}, "
                   "GRADSVC_MAX_BODY_BYTES); send tensors as MessagePack (Content-Type: application/msgpack, the "
                   "SDK's default) or as base64 'b64' instead of JSON number lists, split the batch across "
                   "several requests, or ask the operator to raise GRADSVC_MAX_BODY_BYTES")
        detail = {"limit_bytes": limit, "setting": "GRADSVC_MAX_BODY_BYTES"}
    elif status == 405:
        every = sorted({m.strip() for m in (headers.pop("allow", "") or headers.pop("Allow", "")).split(",")} - {""})
        headers["Allow"] = ", ".join(every)  # RFC 9110: a 405 lists what the resource does accept
        allowed = [m for m in every if m not in ("HEAD", "OPTIONS")]
        code = "method_not_allowed"
        message = f"{method} is not allowed on {path}; it accepts {', '.join(allowed) or 'no method'} (see docs/api.md)"
        if method == "DELETE" and path.startswith("/jobs/"):  # the cancel's route before it moved
            message += "; to cancel the job, POST /jobs/{id}/cancel"
        detail = {"method": method, "allowed": allowed}
    elif status == 404:
        code = "not_found"
        message = f"no route {method} {path}; the API serves {_routes(request)} (see docs/api.md)"
        detail = {"path": path}
    else:
        code = _HTTP_CODES.get(status, "bad_request" if status < 500 else "internal_error")
        message = f"{method} {path} was refused ({status}: {exc.detail}); see docs/api.md"
        detail = {}
    response = error_response(request, code, message, detail, headers or None)
    response.status_code = status
    return response
