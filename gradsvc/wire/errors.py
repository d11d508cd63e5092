"""The error body and the one table of error codes (ERROR_CODES)."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from msgspec import Struct


class ErrorInfo(Struct):
    code: str
    message: str
    detail: dict[str, Any] = {}


class ErrorBody(Struct, omit_defaults=True):
    error: ErrorInfo
    job_id: str | None = None
    status: str | None = None


class ErrorCode(NamedTuple):
    """One error code: its HTTP status, the SDK's exception class, the SDK parent it falls under
    (`request`: the request was wrong; `job`: the job ran and failed; `unavailable`: try again later;
    `server`: a gradsvc bug) and what it means."""

    status: int
    exception: str
    kind: Literal["request", "job", "unavailable", "server"]
    meaning: str


# The one table of error codes: the API renders these statuses, the workers raise these codes, the SDK
# builds its exception classes from it. Only codes something raises are listed (a test checks it).
ERROR_CODES: dict[str, ErrorCode] = {
    "malformed_body": ErrorCode(400, "MalformedBodyError", "request", "the body is not valid JSON or MessagePack"),
    "invalid_body": ErrorCode(400, "InvalidBodyError", "request", "the body does not match the request schema"),
    "invalid_parameter": ErrorCode(400, "InvalidParameterError", "request", "a query or path parameter is invalid"),
    "bad_request": ErrorCode(400, "BadRequestError", "request",
                         "the request is malformed in another way (a header such as Idempotency-Key)"),
    "unauthorized": ErrorCode(401, "UnauthorizedError", "request", "the API key is missing or unknown"),
    "not_found": ErrorCode(404, "NotFoundError", "request", "no such route, or no such job for this API key"),
    "method_not_allowed": ErrorCode(405, "MethodNotAllowedError", "request", "the route does not take this method"),
    "body_too_large": ErrorCode(413, "BodyTooLargeError", "request", "the body is over GRADSVC_MAX_BODY_BYTES"),
    "headers_too_large": ErrorCode(431, "HeadersTooLargeError", "request",
                                   "the request's headers are over GRADSVC_MAX_HEADER_BYTES or GRADSVC_MAX_HEADERS"),
    "unsupported_media_type": ErrorCode(415, "UnsupportedMediaTypeError", "request",
                                        "the body is neither JSON nor MessagePack"),
    "unknown_layer": ErrorCode(422, "UnknownLayerError", "request", "a layer type or argument is not allowed"),
    "shape_mismatch": ErrorCode(422, "ShapeMismatchError", "request", "a layer or op cannot take its input's shape"),
    "bad_weights": ErrorCode(422, "BadWeightsError", "request", "weights are missing, unknown or mis-shaped"),
    "bad_tensor": ErrorCode(422, "BadTensorError", "request", "a tensor is malformed or holds invalid values"),
    "bad_loss": ErrorCode(422, "BadLossError", "request", "the loss is unknown or malformed"),
    "bad_target": ErrorCode(422, "BadTargetError", "request", "the targets do not fit the loss"),
    "bad_option": ErrorCode(422, "BadOptionError", "request", "an option is invalid or cannot apply to the model"),
    "unsupported_op": ErrorCode(422, "UnsupportedOpError", "request", "a graph node names an op outside the allow-list"),
    "no_gradient": ErrorCode(422, "NoGradientError", "request",
                             "the graph's first output has no gradient (an integer tensor, or detached)"),
    "graph_not_found": ErrorCode(422, "GraphNotFoundError", "request",
                                 "model.graph_ref names no graph this service keeps; send the graph again"),
    "tensor_not_found": ErrorCode(422, "TensorNotFoundError", "request",
                                  "a tensor's refs name bytes this service does not keep; upload them again"),
    "too_many_refs": ErrorCode(422, "TooManyRefsError", "request",
                               "a request names more tensor pieces by reference than GRADSVC_MAX_REFS"),
    "too_large": ErrorCode(422, "TooLargeError", "request", "the model or batch is over a size limit"),
    "device_unavailable": ErrorCode(422, "DeviceUnavailableError", "request", "the requested device is not there"),
    # 422 as the IETF's Idempotency-Key draft (draft-ietf-httpapi-idempotency-key-header) answers a key reused
    # with another body: the request is well formed, the key cannot name two requests.
    "idempotency_key_reused": ErrorCode(422, "IdempotencyKeyReusedError", "request",
                                        "an Idempotency-Key was reused for a different request body"),
    "rate_limited": ErrorCode(429, "RateLimitedError", "request", "this API key sent too many jobs; see Retry-After"),
    "non_finite": ErrorCode(422, "NonFiniteError", "job", "the loss or a gradient is NaN or infinite"),
    "canceled": ErrorCode(409, "CanceledError", "job", "the job was canceled"),
    "result_too_large": ErrorCode(413, "ResultTooLargeError", "job", "the result is over GRADSVC_MAX_RESULT_BYTES"),
    "worker_lost": ErrorCode(503, "WorkerLostError", "job", "the worker running the job died or was cut off"),
    "job_lost": ErrorCode(410, "JobLostError", "job",
                          "Redis lost the job's record (restarted without its data); whether it ran is unknown"),
    "input_lost": ErrorCode(410, "InputLostError", "job",
                            "the job's body, handed over as a file (GRADSVC_HANDOFF_DIR), was gone when it ran"),
    "timeout": ErrorCode(504, "JobTimeoutError", "job", "the job ran past GRADSVC_JOB_TIMEOUT_S"),
    "out_of_memory": ErrorCode(507, "OutOfMemoryError", "job", "the device ran out of memory"),
    "result_elsewhere": ErrorCode(421, "ResultElsewhereError", "request",
                                  "the result is a file on another host's GRADSVC_HANDOFF_DIR; ask that host's API"),
    "queue_unavailable": ErrorCode(503, "QueueUnavailableError", "unavailable", "Redis is unreachable"),
    "redis_oom": ErrorCode(503, "RedisOutOfMemoryError", "unavailable",
                           "Redis is at its maxmemory and refuses writes; see Retry-After"),
    "redis_readonly": ErrorCode(503, "RedisReadOnlyError", "unavailable",
                                "Redis is a read-only replica (a failover is in progress or demoted it)"),
    "redis_unavailable": ErrorCode(503, "RedisRefusesWritesError", "unavailable",
                                   "Redis refuses writes (MISCONF: its snapshots fail; NOREPLICAS; MASTERDOWN)"),
    "server_busy": ErrorCode(503, "ServerBusyError", "unavailable",
                             "the API holds GRADSVC_MAX_BODIES_BYTES of request bodies already; see Retry-After"),
    "not_ready": ErrorCode(503, "NotReadyError", "unavailable", "Redis is reachable but no worker is alive"),
    "internal_error": ErrorCode(500, "InternalServerError", "server", "a gradsvc bug; the message says where"),
    # Training sessions (docs/sessions.md)
    "nothing_accumulated": ErrorCode(409, "NothingAccumulatedError", "request",
                                     "optim_step on a session with no gradient accumulated"),
    "too_many_sessions": ErrorCode(429, "TooManySessionsError", "request",
                                   "over GRADSVC_SESSION_MAX_PER_OWNER sessions, or over the owner's byte budget"),
    "workers_full": ErrorCode(503, "WorkersFullError", "request",
                              "the worker holds GRADSVC_SESSION_MAX_PER_WORKER sessions already"),
    "session_resumed": ErrorCode(409, "SessionResumedError", "request",
                                 "the session came back from an older checkpoint: resend the batches from detail.step"),
    "session_lost": ErrorCode(410, "SessionLostError", "job",
                              "the session's checkpoint is gone, or Redis lost the session; it cannot be rebuilt"),
    "session_conflict": ErrorCode(409, "SessionConflictError", "unavailable",
                                  "another worker changed the session while this call ran; it was not applied"),
    "member_lost": ErrorCode(503, "MemberLostError", "unavailable",
                             "a worker holding part of a session over several workers stopped or timed out during "
                             "the call; it was not applied: send it again (the session goes on without it)"),
    "answer_lost": ErrorCode(410, "AnswerLostError", "job",
                             "the call under this idempotency key was applied, but its answer is no longer kept"),
}
