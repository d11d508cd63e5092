"""The retry policy: which failed tries of a request are sent again, after what pause and within what budget
(Client(retries=, retry_for_s=, backoff_s=)); and the Idempotency-Key that makes sending a POST /gradients
again safe."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from gradsvc import wire

from .errors import ConnectionFailedError, GradientClientError

# Errors before the request reached the server: safe to send again whatever the method.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# Errors after it may have: retried for GET and a job's cancel, which create nothing, and for a POST /gradients
# only under its Idempotency-Key, which makes the service answer with the job the first attempt created.
_IDEMPOTENT_ERRORS = (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)
# 503 codes that mean "nothing ran, ask again"; worker_lost is a job that failed (perhaps by killing its
# worker): it reaches the caller as WorkerLostError and is never sent again.
TRANSIENT_CODES = frozenset({"queue_unavailable", "not_ready", "member_lost"})
# The longest pause between two tries: an API back after a restart (`gradsvc up`: ~6 s) is found within it.
_MAX_DELAY_S = 2.0


@dataclass(frozen=True)
class RetryPolicy:
    """A client's retry settings: tries again up to `retries` times (None: no cap), within `retry_for_s`
    seconds of the first try, pausing `backoff_s` doubling up to _MAX_DELAY_S (or the answer's Retry-After)."""

    retries: int | None
    retry_for_s: float
    backoff_s: float

    def delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        delay = min(self.backoff_s * 2**attempt, _MAX_DELAY_S) * random.uniform(0.8, 1.2)
        retry_after = response.headers.get("retry-after") if response is not None else None
        if retry_after:
            try:
                delay = max(delay, float(retry_after))
            except ValueError:
                pass
        return delay


class Tries:
    """One request's tries under a policy: how many so far, since when, and whether another one follows."""

    def __init__(self, policy: RetryPolicy, label: str, replayable: bool) -> None:
        self.policy = policy
        self.label = label  # "POST http://host/gradients", for the error once no try is left
        self.replayable = replayable
        self.attempt = 0
        self.started = time.monotonic()

    def key_age_s(self) -> float | None:
        """On a try again, the seconds since the first (the Idempotency-Key-Age header); None on the first."""
        return time.monotonic() - self.started if self.attempt else None

    def after_failure(self, exc: httpx.TransportError) -> float:
        """The pause before the next try after `exc`; ConnectionFailedError once no try is left or the
        request may have reached the server and is not safe to send again."""
        delay = self.policy.delay(self.attempt)
        if self._budget_left(delay) and (isinstance(exc, _CONNECT_ERRORS)
                                         or (self.replayable and isinstance(exc, _IDEMPOTENT_ERRORS))):
            return self._next(delay)
        attempts = self.attempt + 1
        raise ConnectionFailedError(f"{self.label} failed after {attempts} tries over "
                                    f"{time.monotonic() - self.started:.1f} s (retry_for_s={self.policy.retry_for_s}): "
                                    f"{type(exc).__name__}: {exc}", detail={"attempts": attempts}) from exc

    def after_answer(self, response: httpx.Response, error: Callable[[], wire.ErrorBody | None]) -> float | None:
        """The pause before the next try after a transient 503 (`error()` reads its body: None when it is
        not the API's), or None: the answer is the request's."""
        delay = self.policy.delay(self.attempt, response) if response.status_code == 503 else 0.0
        if response.status_code != 503 or not self.replayable or not self._budget_left(delay):
            return None
        body = error()
        if body is None:
            return self._next(delay)  # not the API's answer (a proxy's): nothing ran behind it
        if body.job_id or body.error.detail.get("job_id"):
            # A job exists (Redis went away while the request waited on it): the caller waits on that job
            # (GET /jobs/{id}) rather than sending the POST again, which, were the Idempotency-Key's record
            # lost with Redis's data, would run the request a second time.
            return None
        return self._next(delay) if body.error.code in TRANSIENT_CODES else None

    def _budget_left(self, delay: float) -> bool:
        """Whether another try fits: within `retries` (when set) and, its pause included, within
        `retry_for_s` of the first try."""
        if self.policy.retries is not None and self.attempt >= self.policy.retries:
            return False
        return time.monotonic() - self.started + delay <= self.policy.retry_for_s

    def _next(self, delay: float) -> float:
        self.attempt += 1
        return delay


def replayable(method: str, path: str, idempotency_key: str | None) -> bool:
    """Whether sending the request again cannot create a second job. POST /estimate and a cancel create nothing."""
    return method != "POST" or path == "/estimate" or path.endswith("/cancel") or idempotency_key is not None


def resumable(exc: GradientClientError) -> bool:
    """A POST /gradients that failed transiently (Redis away while it waited) after its job was created:
    the answer names the job, which the caller then waits on."""
    return exc.code in TRANSIENT_CODES and exc.job_id is not None


def new_key() -> str:
    """One Idempotency-Key per gradients()/submit() call, kept across that call's retries."""
    return str(uuid.uuid4())
