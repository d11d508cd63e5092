"""The SDK's exceptions: one class per error code of the API, all under GradientClientError.

GradientClientError                 code, message, detail, response (httpx.Response | None), status
 +-- ConnectionFailedError           connection_failed: the service could not be reached (after retries)
 +-- WaitTimeoutError                wait_timeout: Job.result(timeout=...) ran out; the job goes on
 +-- UnsupportedModuleError          unsupported_module: an nn.Module the spec cannot express (nothing sent)
 +-- 400 MalformedBodyError, InvalidBodyError, InvalidParameterError, BadRequestError
 +-- 401 UnauthorizedError           404 NotFoundError      405 MethodNotAllowedError   406 NotAcceptableError
 +-- 409 JobCanceledError, CanceledError
 +-- 413 BodyTooLargeError, ResultTooLargeError             415 UnsupportedMediaTypeError
 +-- 422 UnknownLayerError, ShapeMismatchError, BadWeightsError, BadTensorError, BadLossError, BadTargetError,
 |       BadOptionError, TooLargeError, NonFiniteError, DeviceUnavailableError
 +-- 429 RateLimitedError            500 InternalServerError
 +-- 503 QueueUnavailableError, WorkerLostError, NotReadyError   (retried with backoff)
 +-- 504 JobTimeoutError             507 OutOfMemoryError

The code list is a copy of the API's table (the SDK never imports the service); a code this SDK does
not know yet raises GradientClientError itself, with the code as the server sent it.
"""

from __future__ import annotations

from typing import Any

import httpx


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
        """Worth sending again as is: the queue or a worker was unavailable, or the connection failed."""
        return self.code in RETRYABLE_CODES

    @property
    def job_id(self) -> str | None:
        return self.detail.get("job_id")

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class ConnectionFailedError(GradientClientError):
    code = "connection_failed"


class WaitTimeoutError(GradientClientError):
    code = "wait_timeout"


class UnsupportedModuleError(GradientClientError):
    code = "unsupported_module"


class MalformedBodyError(GradientClientError):
    code = "malformed_body"


class InvalidBodyError(GradientClientError):
    code = "invalid_body"


class InvalidParameterError(GradientClientError):
    code = "invalid_parameter"


class BadRequestError(GradientClientError):
    code = "bad_request"


class UnauthorizedError(GradientClientError):
    code = "unauthorized"


class NotFoundError(GradientClientError):
    code = "not_found"


class MethodNotAllowedError(GradientClientError):
    code = "method_not_allowed"


class NotAcceptableError(GradientClientError):
    code = "not_acceptable"


class JobCanceledError(GradientClientError):
    code = "job_canceled"


class CanceledError(GradientClientError):
    code = "canceled"


class BodyTooLargeError(GradientClientError):
    code = "body_too_large"


class ResultTooLargeError(GradientClientError):
    code = "result_too_large"


class UnsupportedMediaTypeError(GradientClientError):
    code = "unsupported_media_type"


class UnknownLayerError(GradientClientError):
    code = "unknown_layer"


class ShapeMismatchError(GradientClientError):
    code = "shape_mismatch"


class BadWeightsError(GradientClientError):
    code = "bad_weights"


class BadTensorError(GradientClientError):
    code = "bad_tensor"


class BadLossError(GradientClientError):
    code = "bad_loss"


class BadTargetError(GradientClientError):
    code = "bad_target"


class BadOptionError(GradientClientError):
    code = "bad_option"


class UnsupportedOpError(GradientClientError):
    code = "unsupported_op"


class GraphNotFoundError(GradientClientError):
    code = "graph_not_found"


class TooLargeError(GradientClientError):
    code = "too_large"


class NonFiniteError(GradientClientError):
    code = "non_finite"


class DeviceUnavailableError(GradientClientError):
    code = "device_unavailable"


class RateLimitedError(GradientClientError):
    code = "rate_limited"

    @property
    def retry_after_s(self) -> float | None:
        value = self.response.headers.get("retry-after") if self.response is not None else None
        return float(value) if value else None


class InternalServerError(GradientClientError):
    code = "internal_error"


class QueueUnavailableError(GradientClientError):
    code = "queue_unavailable"


class WorkerLostError(GradientClientError):
    code = "worker_lost"


class NotReadyError(GradientClientError):
    code = "not_ready"


class JobTimeoutError(GradientClientError):
    code = "timeout"


class OutOfMemoryError(GradientClientError):
    code = "out_of_memory"


# code -> HTTP status, copied from the API's table (service/errors.py STATUS); a test keeps them equal.
CODES: dict[str, int] = {
    "malformed_body": 400, "invalid_body": 400, "invalid_parameter": 400, "bad_request": 400, "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405, "not_acceptable": 406, "job_canceled": 409, "body_too_large": 413,
    "result_too_large": 413, "unsupported_media_type": 415, "unknown_layer": 422, "shape_mismatch": 422,
    "bad_weights": 422, "bad_tensor": 422, "bad_loss": 422, "bad_target": 422, "bad_option": 422,
    "unsupported_op": 422, "graph_not_found": 422,
    "too_large": 422, "non_finite": 422, "device_unavailable": 422, "canceled": 409, "rate_limited": 429,
    "internal_error": 500, "queue_unavailable": 503, "worker_lost": 503, "not_ready": 503, "timeout": 504,
    "out_of_memory": 507,
}
ERRORS: dict[str, type[GradientClientError]] = {
    cls.code: cls for cls in GradientClientError.__subclasses__() if cls.code in CODES
}
RETRYABLE_CODES = frozenset({"connection_failed", *(c for c, s in CODES.items() if s == 503)})


def error_for(code: str, message: str, detail: dict[str, Any] | None = None,
              response: httpx.Response | None = None) -> GradientClientError:
    """The exception for an API error code (GradientClientError itself for a code this SDK does not know)."""
    cls = ERRORS.get(code, GradientClientError)
    return cls(message, code=code, detail=detail, response=response)


__all__ = ["GradientClientError", *(c.__name__ for c in GradientClientError.__subclasses__()), "CODES", "ERRORS",
           "RETRYABLE_CODES", "error_for"]
