"""What Client and AsyncClient (and their Jobs) share, written once: the settings, the request building,
the retry policy with its Idempotency-Key, the resend on graph_not_found / tensor_not_found, waiting on a
job with its progress, and reading answers and errors.

Each call is a flow: a generator that yields an httpx.Request to send (answered with the response and its
body read whole, or with the httpx.TransportError the try ended in) or a pause in seconds (answered with
None), and returns the call's value. client.py drives the flows, with blocking I/O for Client and awaits
for AsyncClient, as httpx's Client and AsyncClient drive one generator auth flow.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from typing import Any, Callable, Generator, TypeVar

import httpx
import msgspec

from gradsvc import wire

from .errors import (
    CanceledError,
    ConnectionFailedError,
    GradientClientError,
    GraphNotFoundError,
    TensorNotFoundError,
    error_for,
)
from .refs import MIN_BYTES
from .request import Prepared, RequestBuilder, call_seed
from .result import GradientResult, build_result, written_back
from .tensors import decode_type
from .transfer import AnswerBuffers, KeptBuffer, _Body, _Pieces
from .waiting import Deadline, Poll, ProgressBar

T = TypeVar("T")
Step = httpx.Request | float  # what a flow asks its driver for: send this request, or sleep this long
Flow = Generator[Step, Any, T]

DEFAULT_URL = "http://127.0.0.1:8000"
MSGPACK = "application/msgpack"
JSON = "application/json"
# Errors before the request reached the server: safe to send again whatever the method.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# Errors after it may have: retried for GET and a job's cancel, which create nothing, and for a POST /gradients
# only under its Idempotency-Key, which makes the service answer with the job the first attempt created.
_IDEMPOTENT_ERRORS = (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)
# 503 codes that mean "nothing ran, ask again"; worker_lost is a job that failed (perhaps by killing its
# worker): it reaches the caller as WorkerLostError and is never sent again.
_TRANSIENT_CODES = frozenset({"queue_unavailable", "not_ready"})
# The longest pause between two tries: an API back after a restart (`gradsvc up`: ~6 s) is found within it.
_MAX_DELAY_S = 2.0


class Driven:
    """A flow being driven: `step` is what it asks for next, `answer(outcome)` resumes it with what that
    step gave; `done` and `value` once it has returned."""

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.done = False
        self.value: Any = None
        self.step: Step = 0.0
        self.answer(None)

    def answer(self, outcome: Any) -> None:
        try:
            self.step = self.flow.send(outcome)
        except StopIteration as stop:
            self.done, self.value = True, stop.value

    def close(self) -> None:
        self.flow.close()  # a driver stopped early (KeyboardInterrupt, a cancelled task): the flow's finally runs


# A result this large (its answer's bytes) that gradients() returned is released with the client's next
# POST /gradients (wire.RELEASE_HEADER): the service drops it then rather than keep it GRADSVC_RESULT_TTL_S
# (a training loop's results would fill its memory). Smaller ones cost little to keep.
# Client(release_results=False) keeps all.
RELEASE_MIN_BYTES = 1 << 20


class BaseClient:
    _http_type: type = httpx.Client  # the subclass's httpx client
    _pieces: type[_Pieces] = _Pieces  # a large body's pieces, as that httpx client takes a stream
    _job_type: type  # the subclass's Job

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 30.0,
                 retries: int | None = None, retry_for_s: float = 20.0, backoff_s: float = 0.25,
                 wire_format: str = "msgpack", headers: dict[str, str] | None = None,
                 transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
                 ref_min_bytes: int | None = MIN_BYTES, release_results: bool = True) -> None:
        if wire_format not in ("msgpack", "json"):
            raise ValueError(f"wire_format must be 'msgpack' or 'json', got {wire_format!r}")
        self.base_url = (base_url or os.environ.get("GRADSVC_URL") or DEFAULT_URL).rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("GRADSVC_API_KEY")
        self.timeout = timeout
        self.retries = retries  # None: as many as retry_for_s allows
        self.retry_for_s = retry_for_s
        self.backoff_s = backoff_s
        self.wire_format = wire_format
        media = MSGPACK if wire_format == "msgpack" else JSON
        self.headers = {"Accept": media, "Content-Type": media, **(headers or {})}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._encoder = msgspec.msgpack.Encoder() if wire_format == "msgpack" else msgspec.json.Encoder()
        self._kept = KeptBuffer(self._encoder)
        self._answers = AnswerBuffers()  # large answers' buffers, reused once free
        self._decoders: dict[tuple[Any, bool], Any] = {}
        self._requests = RequestBuilder(wire_format, self._encoder, ref_min_bytes)
        self._http = self._http_type(base_url=self.base_url, headers=self.headers, transport=transport)
        # Large results gradients() has returned, released with the next POST /gradients (wire.RELEASE_HEADER).
        self.release_results = release_results
        self._held: list[str] = []
        self._held_lock = threading.Lock()

    @property
    def _exports(self) -> dict:
        """The exported graphs this client keeps, per module structure (RequestBuilder.exports)."""
        return self._requests.exports

    @property
    def _refs(self) -> Any:
        """The weight pieces this client hashed and sent (refs.TensorRefs), or None."""
        return self._requests.refs

    def _prepare(self, model: Any, inputs: Any, targets: Any, loss: Any, losses: list | None, dtype: str | None,
                 seed: int, options: dict[str, Any]) -> Prepared:
        return self._requests.prepare(model, inputs, targets, loss, losses, dtype, seed, options)

    # --- the calls ---------------------------------------------------------------------------------
    def _gradients(self, model: Any, inputs: Any, targets: Any, loss: Any, losses: list | None, dtype: str | None,
                   seed: int | None, wait_s: float, timeout: float | None, progress: bool,
                   options: dict[str, Any]) -> Flow[GradientResult]:
        options = dict(options)
        update_buffers = options.pop("update_buffers", True)  # an SDK argument, not a service option
        deadline = Deadline(timeout)  # the whole call's: the export, the server-side wait and the polling
        seed = call_seed(model) if seed is None else seed  # drawn once: a resend repeats it
        args = (model, inputs, targets, loss, losses, dtype, seed, options)
        return (yield from self._resending(args, lambda prepared: self._posting(
            _with(prepared, update_buffers), wait_s, deadline, progress)))

    def _posting(self, prepared: Prepared, wait_s: float, deadline: Deadline, progress: bool) -> Flow[GradientResult]:
        """POST /gradients, the server waiting up to `wait_s` on the job; then, unless that answered with the
        result, GET /jobs/{id} until the job ends (a POST that failed after creating its job names it)."""
        wait = deadline.wait(wait_s)
        with self._held_lock:
            held, self._held = self._held, []
        try:
            response, buf = yield from self._sending("POST", "/gradients", content=prepared, params={"wait": wait},
                                                     extra_s=wait, idempotency_key=_new_key(), release=held)
        except GradientClientError as exc:
            if not _resumable(exc):
                raise
            job_id = exc.job_id
        else:
            if response.status_code == 200:
                result = self._finished(prepared, build_result(self._decode(wire.GradientResult, response, buf),
                                                               prepared.local_names))
                if self.release_results and len(buf) >= RELEASE_MIN_BYTES and result.job_id:
                    with self._held_lock:
                        self._held = [*self._held, result.job_id][-wire.MAX_RELEASED:]
                return result
            job_id = self._decode(wire.JobAccepted, response, buf).job_id
        job = self._job_type(self, job_id, prepared.local_names)
        return self._finished(prepared, (yield from job._waiting(deadline.left(), progress)))

    def _finished(self, prepared: Prepared, result: GradientResult) -> GradientResult:
        self._requests.remember(prepared, result.graph_ref)
        result.upload_bytes = prepared.body_bytes + prepared.sent_bytes
        if prepared.export is not None:
            written_back(prepared, result)
        return result

    def _submitting(self, model: Any, inputs: Any, targets: Any, loss: Any, losses: list | None, dtype: str | None,
                    seed: int | None, options: dict[str, Any]) -> Flow[Any]:
        seed = call_seed(model) if seed is None else seed  # drawn once: a resend repeats it
        args = (model, inputs, targets, loss, losses, dtype, seed, options)

        def post(p: Prepared) -> Flow[tuple]:  # one POST per body, each under its own key: a refused one made no job
            return p, (yield from self._sending("POST", "/gradients", content=p, params={"wait": 0},
                                                idempotency_key=_new_key()))

        prepared, (response, buf) = yield from self._resending(args, post)
        if response.status_code == 200:  # a server that answered anyway: keep the result in the handle
            raw = self._decode(wire.GradientResult, response, buf)
            self._requests.remember(prepared, raw.graph_ref)
            return self._job_type(self, raw.job_id, prepared.local_names, done=build_result(raw, prepared.local_names))
        return self._job_type(self, self._decode(wire.JobAccepted, response, buf).job_id, prepared.local_names,
                              prepared=prepared)

    def _estimating(self, model: Any, inputs: Any, targets: Any, loss: Any, losses: list | None, dtype: str | None,
                    seed: int, options: dict[str, Any]) -> Flow[wire.Estimate]:
        args = (model, inputs, targets, loss, losses, dtype, seed, options)
        response, buf = yield from self._resending(args, lambda p: self._sending("POST", "/estimate", content=p))
        return self._decode(wire.Estimate, response, buf)

    def _getting(self, path: str, tp: Any) -> Flow[Any]:
        response, buf = yield from self._sending("GET", path)
        return self._decode(tp, response, buf)

    def _resending(self, args: tuple, call: Callable[[Prepared], Flow[T]]) -> Flow[T]:
        """call(the request prepared, its new pieces uploaded); once more, prepared anew, when the service
        answers that it lost the graph or a piece the request names (RequestBuilder.lost)."""
        prepared = self._prepare(*args)
        yield from self._uploading(prepared)
        try:
            return (yield from call(prepared))
        except (GraphNotFoundError, TensorNotFoundError) as exc:
            if not self._requests.lost(prepared, exc):
                raise
        prepared = self._prepare(*args)
        yield from self._uploading(prepared)
        return (yield from call(prepared))

    def _uploading(self, prepared: Prepared) -> Flow[None]:
        for ref, data in prepared.uploads:
            if ref not in self._refs.uploaded:
                yield from self._sending("PUT", f"/tensors/{ref}", content=self._pieces(data))
                self._refs.uploaded.add(ref)
                prepared.sent_bytes += len(data)

    # --- one request, tried again ------------------------------------------------------------------
    def _sending(self, method: str, path: str, **kw: Any) -> Flow[tuple[httpx.Response, bytearray | memoryview]]:
        """The request sent (a Prepared `content` encoded, into the kept buffer when free) and tried again
        as the retry policy allows; its answer (response, body), or the error the API answered with."""
        prepared = kw.get("content")
        if not isinstance(prepared, Prepared):
            return (yield from self._trying(method, path, kw))
        with self._kept.encoded(prepared.body, self._pieces) as (content, size):
            prepared.body_bytes = size
            return (yield from self._trying(method, path, {**kw, "content": content}))

    def _trying(self, method: str, path: str, kw: dict[str, Any]) -> Flow[tuple[httpx.Response, bytearray | memoryview]]:
        attempt, started = 0, time.monotonic()
        replayable = _replayable(method, path, kw)
        while True:
            age = {"key_age_s": time.monotonic() - started} if attempt else {}
            outcome = yield self._request(method, path, **kw, **age)
            if isinstance(outcome, httpx.TransportError):
                delay = self._delay(attempt)
                if not self._may_retry(outcome, attempt, replayable, started, delay):
                    raise self._connection_failed(method, path, outcome, attempt + 1, started) from outcome
            else:
                response, body = outcome
                delay = self._delay(attempt, response) if response.status_code == 503 else 0.0
                if not self._may_retry_503(response, body, attempt, replayable, started, delay):
                    if response.status_code >= 400:
                        raise self._error(response, body.done())
                    return response, body.done()
            yield delay
            attempt += 1

    def _request(self, method: str, path: str, *, content: bytes | _Pieces | None = None,
                 params: dict | None = None, extra_s: float = 0.0, idempotency_key: str | None = None,
                 key_age_s: float | None = None, release: list[str] | None = None) -> httpx.Request:
        timeout = httpx.Timeout(self.timeout + extra_s, connect=min(self.timeout, 10.0))
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        if release:
            headers[wire.RELEASE_HEADER] = ", ".join(release)
        if idempotency_key and key_age_s is not None:
            # A retry: the service refuses it (job_lost) if Redis lost its data since the first try, whose
            # job may have run, rather than run it a second time under a key it no longer knows.
            headers["Idempotency-Key-Age"] = f"{key_age_s:.3f}"
        if isinstance(content, _Pieces):  # a stream of known length: Content-Length, not chunked
            headers["Content-Length"] = str(len(content))
        return self._http.build_request(method, path, content=content, params=params, timeout=timeout,
                                        headers=headers or None)

    def _delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        delay = min(self.backoff_s * 2**attempt, _MAX_DELAY_S) * random.uniform(0.8, 1.2)
        retry_after = response.headers.get("retry-after") if response is not None else None
        if retry_after:
            try:
                delay = max(delay, float(retry_after))
            except ValueError:
                pass
        return delay

    def _budget_left(self, attempt: int, started: float, delay: float) -> bool:
        """Whether another try fits: within `retries` (when set) and, its pause included, within
        `retry_for_s` of the first try."""
        if self.retries is not None and attempt >= self.retries:
            return False
        return time.monotonic() - started + delay <= self.retry_for_s

    def _may_retry(self, exc: Exception, attempt: int, replayable: bool, started: float, delay: float) -> bool:
        if not self._budget_left(attempt, started, delay):
            return False
        return isinstance(exc, _CONNECT_ERRORS) or (replayable and isinstance(exc, _IDEMPOTENT_ERRORS))

    def _may_retry_503(self, response: httpx.Response, body: _Body, attempt: int, replayable: bool,
                       started: float, delay: float) -> bool:
        if response.status_code != 503 or not replayable or not self._budget_left(attempt, started, delay):
            return False
        try:
            error = self._decode(wire.ErrorBody, response, body.done())
        except GradientClientError:
            return True  # not the API's answer (a proxy's): nothing ran behind it
        if error.job_id or error.error.detail.get("job_id"):
            # A job exists (Redis went away while the request waited on it): the caller waits on that job
            # (GET /jobs/{id}) rather than sending the POST again, which, were the Idempotency-Key's record
            # lost with Redis's data, would run the request a second time.
            return False
        return error.error.code in _TRANSIENT_CODES

    def _connection_failed(self, method: str, path: str, exc: Exception, attempts: int,
                           started: float) -> ConnectionFailedError:
        return ConnectionFailedError(f"{method} {self.base_url}{path} failed after {attempts} tries over "
                                     f"{time.monotonic() - started:.1f} s (retry_for_s={self.retry_for_s}): "
                                     f"{type(exc).__name__}: {exc}", detail={"attempts": attempts})

    # --- answers -----------------------------------------------------------------------------------
    def _decode(self, tp: Any, response: httpx.Response, buf: bytearray | memoryview) -> Any:
        is_msgpack = response.headers.get("content-type", "").startswith(MSGPACK)
        decoder = self._decoders.get((tp, is_msgpack))
        if decoder is None:
            kind = msgspec.msgpack if is_msgpack else msgspec.json
            decoder = self._decoders[(tp, is_msgpack)] = kind.Decoder(decode_type(tp))
        try:
            return decoder.decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise GradientClientError(f"could not read the answer to {response.request.method} "
                                      f"{response.request.url.path}: {exc}", code="bad_response",
                                      response=response) from None

    def _error(self, response: httpx.Response, buf: bytearray | memoryview) -> GradientClientError:
        # Streamed responses keep no body; the exception's response carries it for the caller.
        response = httpx.Response(response.status_code, headers=response.headers, content=bytes(buf),
                                  request=response.request)
        try:
            body = self._decode(wire.ErrorBody, response, bytearray(buf))
        except GradientClientError:
            return GradientClientError(f"HTTP {response.status_code} from {response.request.url}: "
                                       f"{response.text[:300]}", code=f"http_{response.status_code}",
                                       response=response)
        detail = dict(body.error.detail)
        if body.job_id:
            detail.setdefault("job_id", body.job_id)
        return error_for(body.error.code, body.error.message, detail, response)


class BaseJob:
    """A submitted request (`job_id`; `id` is its alias); its flows, which Job and AsyncJob drive."""

    def __init__(self, client: BaseClient, job_id: str, local_names: dict[str, str] | None = None, *,
                 done: GradientResult | None = None, prepared: Prepared | None = None) -> None:
        self.client = client
        self.job_id = job_id
        self.local_names = local_names or {}
        self._done = done
        self._prepared = prepared  # a graph model's request: its answer's graph_ref goes to the export cache

    @property
    def id(self) -> str:
        """An alias of `job_id` (the name the wire and the errors use), kept for code written against `id`."""
        return self.job_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.job_id!r})"

    def _info(self) -> Flow[wire.JobInfo]:
        return (yield from self.client._getting(f"/jobs/{self.job_id}", wire.JobInfo))

    def _cancel(self) -> Flow[str]:
        response, buf = yield from self.client._sending("POST", f"/jobs/{self.job_id}/cancel")
        return self.client._decode(wire.JobInfo, response, buf).status

    def _waiting(self, timeout: float | None, progress: bool) -> Flow[GradientResult]:
        """GET /jobs/{id} until the job ends: its result, or its error raised as its exception class
        (WaitTimeoutError past `timeout`; the job goes on)."""
        if self._done is not None:
            return self._done
        poll, bar = Poll(timeout), ProgressBar(progress, self.job_id)
        try:
            while True:
                info = yield from self._info()
                bar.update(info)
                result = _outcome(info, self.local_names)
                if result is not None:
                    break
                yield poll.next(self.job_id)
        finally:
            bar.close()
        self._done = result
        if self._prepared is not None:
            self.client._requests.remember(self._prepared, result.graph_ref)
        return result


def _outcome(info: wire.JobInfo, local_names: dict[str, str]) -> GradientResult | None:
    """A job's result once it finished; its error raised once it failed or was canceled; None before."""
    if info.status == "finished":
        return build_result(info.result, local_names)
    if info.status not in ("failed", "canceled"):
        return None
    if info.error is None:
        raise CanceledError(f"job {info.job_id} was canceled", detail={"job_id": info.job_id})
    raise error_for(info.error.code, info.error.message, {**info.error.detail, "job_id": info.job_id})


def _replayable(method: str, path: str, kw: dict[str, Any]) -> bool:
    """Whether sending the request again cannot create a second job. POST /estimate and a cancel create nothing."""
    return (method != "POST" or path == "/estimate" or path.endswith("/cancel")
            or kw.get("idempotency_key") is not None)


def _resumable(exc: GradientClientError) -> bool:
    """A POST /gradients that failed transiently (Redis away while it waited) after its job was created:
    the answer names the job, which the caller then waits on."""
    return exc.code in _TRANSIENT_CODES and exc.job_id is not None


def _with(prepared: Prepared, update_buffers: bool) -> Prepared:
    if not update_buffers:
        prepared.module = None
    return prepared


def _new_key() -> str:
    """One Idempotency-Key per gradients()/submit() call, kept across that call's retries."""
    return str(uuid.uuid4())
