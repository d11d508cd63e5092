"""Client and AsyncClient (the same methods, sync and async, over httpx), and the Job handles they return.

Everything the two share (the request, the retry policy, the resend, waiting on a job, decoding) is one
set of flows in base.py; here each client only drives them: it sends one try and reads its answer
(`_attempt`), and sleeps, blocking or awaited, as httpx's Client and AsyncClient mirror only their I/O.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio
import httpx

from gradsvc import wire

from .base import BaseClient, BaseJob, Driven, Flow, T
from .request import Call
from .result import GradientResult
from .runs import AsyncRun, Run
from .sessions import AsyncSession, Session
from .transfer import _KEPT_BUFFER_MIN, _LARGE_ANSWER, _AsyncPieces, _Body, _Pieces  # noqa: F401  (tests read the sizes here)


class Job(BaseJob):
    """A submitted request (`job_id`; `id` is its alias): status(), cancel(), result(timeout=None, progress=False)."""

    client: "Client"

    def info(self) -> wire.JobInfo:
        """GET /jobs/{id}: status, progress {phase, done, total}, error, timestamps (and the raw result)."""
        return self.client._drive(self._info())

    def status(self) -> str:
        """queued | started | finished | failed | canceled"""
        return self.info().status

    def cancel(self) -> str:
        """POST /jobs/{id}/cancel: a queued job is canceled at once, a running one at its next step."""
        return self.client._drive(self._cancel())

    def result(self, timeout: float | None = None, progress: bool = False) -> GradientResult:
        """Waits for the job: the result, or the job's error raised as its exception class
        (WaitTimeoutError past `timeout`; the job goes on). progress=True shows the job's phase."""
        return self.client._drive(self._waiting(timeout, progress))


class AsyncJob(BaseJob):
    """Job's methods as coroutines."""

    client: "AsyncClient"

    async def info(self) -> wire.JobInfo:
        return await self.client._drive(self._info())

    async def status(self) -> str:
        return (await self.info()).status

    async def cancel(self) -> str:
        return await self.client._drive(self._cancel())

    async def result(self, timeout: float | None = None, progress: bool = False) -> GradientResult:
        return await self.client._drive(self._waiting(timeout, progress))


class Client(BaseClient):
    """The sync SDK client. `Client(base_url, api_key=None, timeout=30.0, retry_for_s=20.0)`; a context manager.

    A request that could not reach the API (or got a transient 503) is tried again with backoff (0.25 s
    doubling to 2 s) for up to `retry_for_s` seconds in all, which covers an API restart (`gradsvc up`: ~6 s);
    `retries` also caps the number of tries again when set.

    `wire_format="msgpack"` (raw tensor bytes, the default) or "json"; `transport` is an httpx transport
    (e.g. httpx.MockTransport in tests). base_url and api_key default to $GRADSVC_URL and $GRADSVC_API_KEY.
    """

    _http_type = httpx.Client
    _pieces = _Pieces
    _job_type = Job

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        self._kept.release()
        self._answers.release()

    def _drive(self, flow: Flow[T]) -> T:
        with contextlib.closing(Driven(flow)) as run:
            while not run.done:
                run.answer(self._attempt(run.step) if isinstance(run.step, httpx.Request) else time.sleep(run.step))
            return run.value

    def _attempt(self, request: httpx.Request) -> tuple[httpx.Response, _Body] | httpx.TransportError:
        """One try: the response with its body read whole, or the transport error it ended in."""
        try:
            response = self._http.send(request, stream=True)
            try:
                body = _Body(response, self._answers)
                if not body.read_direct(response):
                    for chunk in response.iter_bytes():
                        body.add(chunk)
            finally:
                response.close()
        except httpx.TransportError as exc:
            return exc
        return response, body

    def _send(self, method: str, path: str, **kw: Any) -> tuple[httpx.Response, bytearray | memoryview]:
        return self._drive(self._sending(method, path, **kw))

    def gradients(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                  losses: list | None = None, dtype: str | None = None, seed: int | None = None, wait_s: float = 30.0,
                  timeout: float | None = None, progress: bool = False, **options: Any) -> GradientResult:
        """The gradients of `loss(model(inputs), targets)` for every parameter, computed by the service.

        `model`: an nn.Module of allow-listed layers (its weights go with it) or a spec dict; `options`
        are those of docs/api.md (numcheck="off", memory=False, per_sample="norms", outputs=True, ...). A module
        sent as a graph gets the buffers its forward wrote (batch norm's statistics) written back, as a local
        step would leave them, unless `update_buffers=False` (docs/training-code.md). Waits for the job up
        to `timeout` seconds in all (None: as long as it takes), then raises WaitTimeoutError; `wait_s` is how
        long the POST itself waits on the server (its `?wait=`, cut to what `timeout` leaves) before polling
        GET /jobs/{id}.
        """
        return self._drive(self._gradients(Call(model, inputs, targets, loss, losses=losses, dtype=dtype, seed=seed,
                                                options=options, wait_s=wait_s, timeout=timeout, progress=progress)))

    def submit(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
               losses: list | None = None, dtype: str | None = None, seed: int | None = None, **options: Any) -> Job:
        """Queues the request and returns at once with its Job."""
        return self._drive(self._submitting(Call(model, inputs, targets, loss, losses=losses, dtype=dtype, seed=seed,
                                                 options=options)))

    def job(self, job_id: str) -> Job:
        """A handle on a job submitted earlier (tensor names as the service gives them)."""
        return Job(self, job_id)

    def estimate(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                 losses: list | None = None, dtype: str | None = None, seed: int = 0,
                 **options: Any) -> wire.Estimate:
        """Parameter count and per-layer activation memory, predicted on the meta device; nothing is queued."""
        return self._drive(self._estimating(Call(model, inputs, targets, loss, losses=losses, dtype=dtype, seed=seed,
                                                 options=options)))

    def run(self, name: str, start: int = 0) -> Run:
        """A training run: `run.gradients(...)` takes gradients()'s arguments and records each call as the
        run's next step (from `start`), which GET /runs/{name}, the run's page and /metrics show."""
        return Run(self, name, start)

    def session(self, model: Any, optimizer: str = "adamw", **kwargs: Any) -> Session:
        """A training session (docs/sessions.md): the weights and the optimizer (`sgd`, `adam`, `adamw`; torch's
        arguments as keywords: lr, betas, weight_decay, momentum, ...) stay on a worker; `run`, `clip`, `dtype`,
        `seed`, `device`, `checkpoint_every`, `freeze` as POST /sessions takes them. Created with its first batch."""
        return Session(self, model, optimizer, **kwargs)

    def runs(self) -> list[wire.RunSummary]:
        """GET /runs: this key's runs, most recently stepped first."""
        return self._drive(self._getting("/runs", list[wire.RunSummary]))

    def layers(self) -> list[wire.LayerInfo]:
        return self._drive(self._getting("/layers", list[wire.LayerInfo]))

    def health(self, ready: bool = False) -> dict[str, Any]:
        """GET /healthz ({"status": "ok"}); with ready=True GET /readyz (Redis and a live worker)."""
        return self._drive(self._getting("/readyz" if ready else "/healthz", dict[str, Any]))


class AsyncClient(BaseClient):
    """Client's methods as coroutines: `async with AsyncClient(url) as c: r = await c.gradients(...)`."""

    _http_type = httpx.AsyncClient
    _pieces = _AsyncPieces
    _job_type = AsyncJob

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        self._kept.release()
        self._answers.release()

    async def _drive(self, flow: Flow[T]) -> T:
        with contextlib.closing(Driven(flow)) as run:
            while not run.done:
                run.answer(await self._attempt(run.step) if isinstance(run.step, httpx.Request)
                           else await anyio.sleep(run.step))
            return run.value

    async def _attempt(self, request: httpx.Request) -> tuple[httpx.Response, _Body] | httpx.TransportError:
        """Client._attempt, awaited."""
        try:
            response = await self._http.send(request, stream=True)
            try:
                body = _Body(response, self._answers)
                async for chunk in response.aiter_bytes():
                    body.add(chunk)
            finally:
                await response.aclose()
        except httpx.TransportError as exc:
            return exc
        return response, body

    async def _send(self, method: str, path: str, **kw: Any) -> tuple[httpx.Response, bytearray | memoryview]:
        return await self._drive(self._sending(method, path, **kw))

    async def gradients(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                        losses: list | None = None, dtype: str | None = None, seed: int | None = None,
                        wait_s: float = 30.0, timeout: float | None = None, progress: bool = False,
                        **options: Any) -> GradientResult:
        """Client.gradients, awaited."""
        return await self._drive(self._gradients(Call(model, inputs, targets, loss, losses=losses, dtype=dtype,
                                                      seed=seed, options=options, wait_s=wait_s, timeout=timeout,
                                                      progress=progress)))

    async def submit(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                     losses: list | None = None, dtype: str | None = None, seed: int | None = None,
                     **options: Any) -> AsyncJob:
        """Client.submit, awaited."""
        return await self._drive(self._submitting(Call(model, inputs, targets, loss, losses=losses, dtype=dtype,
                                                       seed=seed, options=options)))

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def estimate(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                       losses: list | None = None, dtype: str | None = None, seed: int = 0,
                       **options: Any) -> wire.Estimate:
        return await self._drive(self._estimating(Call(model, inputs, targets, loss, losses=losses, dtype=dtype,
                                                       seed=seed, options=options)))

    def run(self, name: str, start: int = 0) -> AsyncRun:
        """Client.run, with coroutine methods."""
        return AsyncRun(self, name, start)

    def session(self, model: Any, optimizer: str = "adamw", **kwargs: Any) -> AsyncSession:
        """Client.session, with coroutine methods (`async with client.session(...) as s: await s.step(x, y)`)."""
        return AsyncSession(self, model, optimizer, **kwargs)

    async def runs(self) -> list[wire.RunSummary]:
        return await self._drive(self._getting("/runs", list[wire.RunSummary]))

    async def layers(self) -> list[wire.LayerInfo]:
        return await self._drive(self._getting("/layers", list[wire.LayerInfo]))

    async def health(self, ready: bool = False) -> dict[str, Any]:
        return await self._drive(self._getting("/readyz" if ready else "/healthz", dict[str, Any]))


__all__ = ["AsyncClient", "AsyncJob", "AsyncRun", "AsyncSession", "Client", "Job", "Run", "Session"]
