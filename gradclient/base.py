"""What Client and AsyncClient (and their Jobs) share, written once: the settings, the request building,
the retry policy with its Idempotency-Key (retry.py), the resend on graph_not_found / tensor_not_found,
waiting on a job with its progress, and reading answers and errors (transfer.py's AnswerReader).

Each call is a flow: a generator that yields an httpx.Request to send (answered with the response and its
body read whole, or with the httpx.TransportError the try ended in) or a pause in seconds (answered with
None), and returns the call's value. client.py drives the flows, with blocking I/O for Client and awaits
for AsyncClient, as httpx's Client and AsyncClient drive one generator auth flow.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import httpx
import msgspec

from gradsvc import wire

from .errors import (
    CanceledError,
    GradientClientError,
    GraphNotFoundError,
    TensorNotFoundError,
    error_for,
)
from .refs import MIN_BYTES
from .request import Call, Outgoing, RequestBuilder
from .result import GradientResult, HeldResults, build_result, written_back
from .retry import RetryPolicy, Tries, new_key, replayable, resumable
from .transfer import MSGPACK, AnswerBuffers, AnswerReader, KeptBuffer, Send, _Pieces
from .waiting import Deadline, Poll, ProgressBar

T = TypeVar("T")
Step = httpx.Request | float  # what a flow asks its driver for: send this request, or sleep this long
Flow = Generator[Step, Any, T]

DEFAULT_URL = "http://127.0.0.1:8000"
JSON = "application/json"


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
        self._reader = AnswerReader()
        self._requests = RequestBuilder(wire_format, self._encoder, ref_min_bytes)
        self._http = self._http_type(base_url=self.base_url, headers=self.headers, transport=transport)
        self.release_results = release_results
        self._held = HeldResults()  # large results gradients() returned, released with the next POST /gradients

    @property
    def _exports(self) -> dict:
        """The exported graphs this client keeps, per module structure (RequestBuilder.exports)."""
        return self._requests.exports

    @property
    def _refs(self) -> Any:
        """The weight pieces this client hashed and sent (refs.TensorRefs), or None."""
        return self._requests.refs

    def _prepare(self, call: Call) -> Outgoing:
        return self._requests.prepare(call)

    # --- the calls ---------------------------------------------------------------------------------
    def _gradients(self, call: Call) -> Flow[GradientResult]:
        deadline = Deadline(call.timeout)  # the whole call's: the export, the server-side wait and the polling
        call = call.seeded()  # drawn once: a resend repeats it
        return (yield from self._resending(call, lambda out: self._posting(out, call, deadline)))

    def _posting(self, out: Outgoing, call: Call, deadline: Deadline) -> Flow[GradientResult]:
        """POST /gradients, the server waiting up to `wait_s` on the job; then, unless that answered with the
        result, GET /jobs/{id} until the job ends (a POST that failed after creating its job names it)."""
        if not call.update_buffers:
            out.module = None
        wait = deadline.wait(call.wait_s)
        try:
            response, buf = yield from self._sending("POST", "/gradients", content=out, params={"wait": wait},
                                                     extra_s=wait, idempotency_key=new_key(),
                                                     release=self._held.take())
        except GradientClientError as exc:
            if not resumable(exc):
                raise
            job_id = exc.job_id
        else:
            if response.status_code == 200:
                result = self._finished(out, build_result(self._reader.decode(wire.GradientResult, response, buf),
                                                          out.local_names))
                if self.release_results:
                    self._held.add(result.job_id, len(buf))
                return result
            job_id = self._reader.decode(wire.JobAccepted, response, buf).job_id
        job = self._job_type(self, job_id, out.local_names)
        return self._finished(out, (yield from job._waiting(deadline.left(), call.progress)))

    def _finished(self, out: Outgoing, result: GradientResult) -> GradientResult:
        self._requests.remember(out, result.graph_ref)
        result.upload_bytes = out.body_bytes + out.sent_bytes
        if out.export is not None:
            written_back(out, result)
        return result

    def _submitting(self, call: Call) -> Flow[Any]:
        call = call.seeded()  # drawn once: a resend repeats it

        def post(out: Outgoing) -> Flow[tuple]:  # one POST per body, each under its own key: a refused one made no job
            return out, (yield from self._sending("POST", "/gradients", content=out, params={"wait": 0},
                                                  idempotency_key=new_key()))

        out, (response, buf) = yield from self._resending(call, post)
        if response.status_code == 200:  # a server that answered anyway: keep the result in the handle
            raw = self._reader.decode(wire.GradientResult, response, buf)
            self._requests.remember(out, raw.graph_ref)
            return self._job_type(self, raw.job_id, out.local_names, done=build_result(raw, out.local_names))
        return self._job_type(self, self._reader.decode(wire.JobAccepted, response, buf).job_id, out.local_names,
                              outgoing=out)

    def _estimating(self, call: Call) -> Flow[wire.Estimate]:
        response, buf = yield from self._resending(call, lambda out: self._sending("POST", "/estimate", content=out))
        return self._reader.decode(wire.Estimate, response, buf)

    def _getting(self, path: str, tp: Any) -> Flow[Any]:
        response, buf = yield from self._sending("GET", path)
        return self._reader.decode(tp, response, buf)

    def _resending(self, call: Call, send: Callable[[Outgoing], Flow[T]]) -> Flow[T]:
        """send(the request prepared, its new pieces uploaded); once more, prepared anew, when the service
        answers that it lost the graph or a piece the request names (RequestBuilder.lost)."""
        out = self._prepare(call)
        yield from self._uploading(out)
        try:
            return (yield from send(out))
        except (GraphNotFoundError, TensorNotFoundError) as exc:
            if not self._requests.lost(out, exc):
                raise
        out = self._prepare(call)
        yield from self._uploading(out)
        return (yield from send(out))

    def _uploading(self, out: Outgoing) -> Flow[None]:
        for ref, data in out.uploads:
            if ref not in self._refs.uploaded:
                yield from self._sending("PUT", f"/tensors/{ref}", content=self._pieces(data))
                self._refs.uploaded.add(ref)
                out.sent_bytes += len(data)

    # --- one request, tried again ------------------------------------------------------------------
    def _sending(self, method: str, path: str, **kw: Any) -> Flow[tuple[httpx.Response, bytearray | memoryview]]:
        """The request (transfer.Send's fields; an Outgoing `content` encoded, into the kept buffer when
        free) sent and tried again as the retry policy allows; its answer (response, body), or the error
        the API answered with."""
        send = Send(method, path, **kw)
        if not isinstance(send.content, Outgoing):
            return (yield from self._trying(send))
        out = send.content
        with self._kept.encoded(out.body, self._pieces) as (content, size):
            out.body_bytes = size
            return (yield from self._trying(replace(send, content=content)))

    def _trying(self, send: Send) -> Flow[tuple[httpx.Response, bytearray | memoryview]]:
        policy = RetryPolicy(self.retries, self.retry_for_s, self.backoff_s)
        tries = Tries(policy, f"{send.method} {self.base_url}{send.path}",
                      replayable(send.method, send.path, send.idempotency_key))
        while True:
            outcome = yield send.request(self._http, self.timeout, tries.key_age_s())
            if isinstance(outcome, httpx.TransportError):
                delay = tries.after_failure(outcome)  # ConnectionFailedError when no try is left
            else:
                response, buf = outcome[0], outcome[1].done()
                delay = tries.after_answer(response, partial(self._reader.error_body, response, buf))
                if delay is None:
                    if response.status_code >= 400:
                        raise self._reader.error(response, buf)
                    return response, buf
            yield delay


class BaseJob:
    """A submitted request (`job_id`; `id` is its alias); its flows, which Job and AsyncJob drive."""

    def __init__(self, client: BaseClient, job_id: str, local_names: dict[str, str] | None = None, *,
                 done: GradientResult | None = None, outgoing: Outgoing | None = None) -> None:
        self.client = client
        self.job_id = job_id
        self.local_names = local_names or {}
        self._done = done
        self._outgoing = outgoing  # a graph model's request: its answer's graph_ref goes to the export cache

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
        return self.client._reader.decode(wire.JobInfo, response, buf).status

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
        if self._outgoing is not None:
            self.client._requests.remember(self._outgoing, result.graph_ref)
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
