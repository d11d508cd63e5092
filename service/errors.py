"""Error codes, their HTTP statuses (one table), and the one renderer every error goes through.

ServiceError            raised by routes; carries a code from gradsvc.wire.ERROR_CODES (the one table)
 (engine errors, Litestar's HTTP exceptions and Redis outages are mapped onto the same codes)
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gradsvc.wire import ERROR_CODES, ErrorBody, ErrorInfo
from workers.engine import EngineError

from .encoding import respond

log = logging.getLogger("gradsvc.api")

STATUS: dict[str, int] = {code: entry.status for code, entry in ERROR_CODES.items()}
_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
               413: "body_too_large", 415: "unsupported_media_type", 429: "rate_limited"}


class ServiceError(Exception):
    def __init__(self, code: str, message: str, headers: dict[str, str] | None = None, **detail: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail
        self.headers = headers or {}

    @property
    def status(self) -> int:
        return STATUS[self.code]


def status_for(code: str) -> int:
    return STATUS.get(code, 500)


def error_response(request: Request, code: str, message: str, detail: dict | None = None,
                   headers: dict[str, str] | None = None, **extra: Any) -> Response:
    body = ErrorBody(error=ErrorInfo(code=code, message=message, detail=detail or {}), **extra)
    return respond(request, body, status=status_for(code), headers=headers)


def handle_exception(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ServiceError):
        return error_response(request, exc.code, exc.message, exc.detail, exc.headers)
    if isinstance(exc, EngineError):
        return error_response(request, exc.code, exc.message, exc.detail)
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return error_response(request, "queue_unavailable", f"the job queue (Redis) is unreachable: {exc}; "
                              "retry shortly", headers={"Retry-After": "2"})
    if isinstance(exc, ValidationException):
        return error_response(request, "invalid_body", f"{exc.detail}: {exc.extra}" if exc.extra else str(exc.detail))
    if isinstance(exc, HTTPException):
        code = _HTTP_CODES.get(exc.status_code, "bad_request" if exc.status_code < 500 else "internal_error")
        response = error_response(request, code, str(exc.detail))
        response.status_code = exc.status_code if exc.status_code != 500 else 500
        return response
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request, "internal_error", f"unexpected {type(exc).__name__}; this is a gradsvc bug")
