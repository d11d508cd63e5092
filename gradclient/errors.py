"""The SDK's exceptions: one class per API error code, under three parents, all under GradientClientError.

GradientClientError                  code, message, detail, response (httpx.Response | None), status, job_id
 +-- UnsupportedModuleError           unsupported_module: an nn.Module neither a layer spec nor torch.export
 |                                    can express (nothing was sent)
 +-- WaitTimeoutError                 wait_timeout: Job.result(timeout=...) ran out; the job goes on
 +-- RequestError                     4xx: the request was wrong; fix it, sending it again will not help
 |    +-- MalformedBodyError, InvalidBodyError, InvalidParameterError, BadRequestError 400
 |    +-- UnauthorizedError 401, NotFoundError 404, MethodNotAllowedError 405
 |    +-- BodyTooLargeError 413, UnsupportedMediaTypeError 415, RateLimitedError 429 (retry_after_s)
 |    +-- UnknownLayerError, ShapeMismatchError, BadWeightsError, BadTensorError, BadLossError,
 |        BadTargetError, BadOptionError, UnsupportedOpError, NoGradientError, GraphNotFoundError, TensorNotFoundError,
 |        TooLargeError, DeviceUnavailableError, IdempotencyKeyReusedError     422
 +-- JobFailedError                   the job was queued, ran and failed (job_id says which); never retried
 |    +-- NonFiniteError 422, CanceledError 409, InputLostError 410, ResultTooLargeError 413
 |    +-- WorkerLostError 503, JobTimeoutError 504, OutOfMemoryError 507
 +-- ServiceUnavailableError          try again later (the SDK retries these with backoff)
 |    +-- ConnectionFailedError        connection_failed: the service could not be reached
 |    +-- QueueUnavailableError 503, NotReadyError 503
 |    +-- RedisOutOfMemoryError, RedisReadOnlyError, RedisRefusesWritesError 503: Redis refuses writes
 |    +-- ServerBusyError 503: the API holds GRADSVC_MAX_BODIES_BYTES of bodies already
 |    +-- SessionConflictError 409: another worker changed the session meanwhile; the call was not applied
 |    +-- MemberLostError 503: a worker of a session over several was lost during the call; not applied
 +-- InternalServerError              500: a gradsvc bug

The code-specific classes are built from gradsvc.wire.ERROR_CODES, the table the API and the workers
use too; a code this SDK does not know yet raises its parent by status (or GradientClientError), with
the code as the server sent it.
"""

from __future__ import annotations

from typing import Any

import httpx

from gradsvc.wire import ERROR_CODES


class GradientClientError(Exception):
    """Root of every SDK error. `code` is the API's error code; `response` the HTTP answer, if any."""

    code = "error"

    def __init__(self, message: str, *, code: str | None = None, detail: dict[str, Any] | None = None,
                 response: httpx.Response | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or type(self).code
        self.detail = detail or {}
        self.response = response

    @property
    def status(self) -> int | None:
        return self.response.status_code if self.response is not None else None

    @property
    def is_retryable(self) -> bool:
        """Worth sending again as is: the queue or the service was unavailable, or the connection failed.
        A job that ran and failed (worker_lost, out_of_memory, timeout) is not: it would run again."""
        return isinstance(self, ServiceUnavailableError)

    @property
    def job_id(self) -> str | None:
        return self.detail.get("job_id")

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class RequestError(GradientClientError):
    """The request was wrong (a 4xx): the message says what, where and how to fix it."""

    code = "request_error"


class JobFailedError(GradientClientError):
    """The job was accepted, ran and failed; `job_id` names it."""

    code = "job_failed"


class ServiceUnavailableError(GradientClientError):
    """The service could not take the request now; retried with backoff, then raised."""

    code = "unavailable"


class _RetryAfter:
    @property
    def retry_after_s(self) -> float | None:
        value = self.response.headers.get("retry-after") if self.response is not None else None  # type: ignore[attr-defined]
        return float(value) if value else None


_PARENTS: dict[str, type[GradientClientError]] = {
    "request": RequestError, "job": JobFailedError, "unavailable": ServiceUnavailableError,
    "server": GradientClientError,
}
_MIXINS: dict[str, tuple[type, ...]] = {"rate_limited": (_RetryAfter,)}


def _define(name: str, parents: tuple[type, ...], code: str, doc: str) -> type[GradientClientError]:
    cls = type(name, parents, {"code": code, "__doc__": doc, "__module__": __name__})
    globals()[name] = cls
    return cls


# The codes the SDK raises itself (the API never sends them): code -> class name, parent, meaning.
_SDK_CODES: dict[str, tuple[str, type[GradientClientError], str]] = {
    "unsupported_module": ("UnsupportedModuleError", GradientClientError,
                           "an nn.Module neither a layer spec nor torch.export can express (nothing was sent)"),
    "wait_timeout": ("WaitTimeoutError", GradientClientError, "Job.result(timeout=...) ran out; the job goes on"),
    "connection_failed": ("ConnectionFailedError", ServiceUnavailableError, "the service could not be reached"),
}
for _code, (_name, _parent, _meaning) in _SDK_CODES.items():
    _define(_name, (_parent,), _code, f"{_code}: {_meaning}.")

# code -> HTTP status and code -> exception class, both from the one table.
CODES: dict[str, int] = {code: entry.status for code, entry in ERROR_CODES.items()}
ERRORS: dict[str, type[GradientClientError]] = {
    code: _define(entry.exception, (*_MIXINS.get(code, ()), _PARENTS[entry.kind]), code,
                  f"{code} ({entry.status}): {entry.meaning}.")
    for code, entry in ERROR_CODES.items()
}
RETRYABLE_CODES = frozenset({"connection_failed", *(c for c, e in ERROR_CODES.items() if e.kind == "unavailable")})


def error_for(code: str, message: str, detail: dict[str, Any] | None = None,
              response: httpx.Response | None = None) -> GradientClientError:
    """The exception for an API error code; for a code this SDK does not know, the parent its HTTP status
    implies (4xx RequestError, 503 ServiceUnavailableError), else GradientClientError itself."""
    cls = ERRORS.get(code)
    if cls is None:
        status = response.status_code if response is not None else 0
        cls = RequestError if 400 <= status < 500 else ServiceUnavailableError if status == 503 else GradientClientError
    return cls(message, code=code, detail=detail, response=response)


__all__ = ["GradientClientError", "RequestError", "JobFailedError", "ServiceUnavailableError",
           *(name for name, _, _ in _SDK_CODES.values()),
           *(e.exception for e in ERROR_CODES.values()), "CODES", "ERRORS", "RETRYABLE_CODES", "error_for"]
