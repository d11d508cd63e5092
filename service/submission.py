"""A POST /gradients from what its route read to its outcome: the results its client holds released, the
checks that read Redis (tensor and graph refs, the rate limit), validation on the meta device (an invalid spec
never reaches the queue), the graph kept for the next request, the enqueue and the wait for the job's end; which
requests take that way on the event loop, without a thread hop; and POST /estimate's check."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable
from dataclasses import dataclass

import anyio.to_thread
import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gradsvc.broker import affinity
from gradsvc.broker import blobs as tensor_refs
from gradsvc.broker.blobs import BlobStore
from gradsvc.broker.connection import Exchange, send_async
from gradsvc.broker.graphs import GraphStore
from gradsvc.broker.runs import RunStore
from gradsvc.engine import Engine
from gradsvc.engine.prepare import Prepared
from gradsvc.wire import (
    ITEMSIZE,
    MAX_RUN_STEP,
    Estimate,
    EstimateLimits,
    GradientRequest,
    JobInfo,
)

from .api_metrics import ApiMetrics
from .auth import Auth
from .device_limits import DeviceLimits
from .enqueue import Enqueuer, JobRequest
from .exceptions import ServiceError
from .job_reader import LEASE_CHECK_S, JobReader, slice_commands, unavailable

# A body this small with a layer spec is validated on the event loop (a spec seen before: ~0.1 ms; a new
# one: a few ms, once), sparing the thread hop (bench/summary.py's small job).
_EVENT_LOOP_BODY_BYTES = 16 << 10


def _raise_refused(replies: list) -> None:
    """A transaction's first error, as send_async raises it: a command Redis refused (EXEC then aborts), else
    one that failed inside EXEC."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    for reply in replies[-1] or ():
        if isinstance(reply, Exception):
            raise reply


def small_layer_spec(req: GradientRequest, body: bytes) -> bool:
    """A body small enough to check on the event loop, of a layer spec (a graph may need a Redis look-up),
    with no tensor by reference (its pieces are looked up in Redis)."""
    return len(body) <= _EVENT_LOOP_BODY_BYTES and req.model.layers is not None and not tensor_refs.has_refs(req)


@dataclass(slots=True)  # slots, not frozen: made per request, in a third of the time
class Submission:
    """A POST /gradients as its route read it, before its body: who sent it and what its query and headers ask."""

    owner: str
    wait_s: float  # `wait`, clamped to GRADSVC_MAX_WAIT_S
    released: list[str]  # Gradsvc-Release-Results: job ids whose results the client holds
    key: str | None = None  # Idempotency-Key
    key_age_s: float | None = None  # Idempotency-Key-Age, read only with a key


@dataclass(slots=True)
class Outcome:
    """What a POST /gradients came to: its job, whether it was enqueued now, and what to answer. `stored`: the
    finished job's result as stored (MessagePack). Else `info`, the job as GET /jobs/{id} reads it now:
    finished with its result, failed with its error, or still running; `accepted`: 202 with info's status,
    whatever it is (wait=0 on a new job: info is read without its result)."""

    job_id: str
    created: bool
    encoding: str  # options.encoding: how a JSON answer writes the result's tensors
    stored: bytes | None = None
    info: JobInfo | None = None
    accepted: bool = False


@dataclass(eq=False)
class Submitter:
    engine: Engine
    graphs: GraphStore
    blobs: BlobStore
    auth: Auth
    enqueuer: Enqueuer
    reader: JobReader
    metrics: ApiMetrics
    runs: RunStore | None = None  # None: run steps are not checked against the run's state before the queue
    limits: DeviceLimits | None = None  # the limits of the workers a job may go to (None: the engine's)

    async def check_run(self, req: GradientRequest, owner: str) -> None:
        """A run's step against the run as Redis holds it (one round trip): a step without a number after
        MAX_RUN_STEP, and weights the run would keep past the owner's byte budget, are refused before the queue."""
        run, bounds = req.run, self.runs.bounds
        replies = await send_async(self.reader.aredis, self.runs.usage_commands(owner, run.name))
        usage = self.runs.usage_of(replies, run.name)
        if run.step is None and usage.last_step is not None and usage.last_step >= MAX_RUN_STEP:
            raise ServiceError("bad_option", f"run {run.name!r} is at step {usage.last_step}, the largest step number "
                               f"({MAX_RUN_STEP}), so the next one cannot be numbered; start a new run, or send "
                               "run.step to replace a recorded step", option="run.step", run=run.name,
                               last_step=usage.last_step)
        size = sum(ITEMSIZE.get(t.dtype, 8) * math.prod(t.shape) for t in (req.model.weights or {}).values())
        if 0 < size <= bounds.weights_max_bytes and usage.other_weights_bytes + size > bounds.weights_budget_bytes:
            raise ServiceError("too_large", f"run {run.name!r} keeps a copy of its step's weights ({size} bytes) for "
                               f"the next step's update ratio, and this API key's runs already keep "
                               f"{usage.other_weights_bytes} bytes: together over GRADSVC_TENSOR_BUDGET_BYTES="
                               f"{bounds.weights_budget_bytes}; delete runs you no longer need (DELETE /runs/{{name}})",
                               run=run.name, bytes=size, used_bytes=usage.other_weights_bytes,
                               setting="GRADSVC_TENSOR_BUDGET_BYTES", limit=bounds.weights_budget_bytes)

    async def submit(self, asked: Submission, received: Awaitable[tuple[bytes, str, GradientRequest]]) -> Outcome:
        """`received`: the body as it comes in (parsing.read_request: the bytes to queue, their format, the
        request), read while the results the client holds are dropped (in a thread: Redis, then their files)."""
        reader, owner = self.reader, asked.owner
        releasing = (asyncio.ensure_future(anyio.to_thread.run_sync(reader.release, asked.released, owner))
                     if asked.released else None)
        try:
            body, fmt, req = await received
        finally:
            recycled = False
            if releasing is not None:
                count, recycled = await releasing
                self.metrics.results_released.inc(count)
        if req.run is not None and self.runs is not None:
            await self.check_run(req, owner)
        job = JobRequest(body, fmt, owner, req.options.device, key=asked.key, key_age_s=asked.key_age_s)
        job_id, created, waited = await self._enqueue(req, job, recycled, asked.wait_s)
        encoding = req.options.encoding
        if created and waited is None:  # _enqueue_and_wait counts its job when Redis has taken it
            self.metrics.jobs_submitted.inc()
        if created and asked.wait_s == 0:  # plain async: the job as it is now, even one a worker has finished already
            return Outcome(job_id, created, encoding, info=await reader.info(job_id, owner, with_result=False),
                           accepted=True)
        ended, raw = waited if waited is not None else await reader.wait(job_id, asked.wait_s)
        if ended and raw is not None:
            return Outcome(job_id, created, encoding, stored=raw)
        # Failed, or still running: the answer is what GET /jobs/{id} says now (it may have ended meanwhile).
        return Outcome(job_id, created, encoding, info=await reader.info(job_id, owner))

    async def _enqueue(self, req: GradientRequest, job: JobRequest, recycled: bool,
                       wait_s: float) -> tuple[str, bool, tuple[bool, bytes | None] | None]:
        """(job id, whether it was enqueued now, and, when the enqueue waited for the job too, what the wait
        came to: JobReader.wait's answer)."""
        prep = self.prepare_inline(req, job.body, job.key)
        if self.on_event_loop(prep):
            # A small layer-spec request that needs nothing else of Redis: checked on the event loop (a
            # spec seen before costs ~0.1 ms) and enqueued over the async connection, with no thread hop;
            # with a wait, the enqueue and the wait's first read go to Redis together.
            if wait_s > 0 and not self.enqueuer.queues.replicated:  # with Sentinel a replica acknowledges it first
                job_id = await self.enqueuer.new_job_id()
                return job_id, True, await self._enqueue_and_wait(job, job_id, wait_s)
            return await self.enqueuer.enqueue_async(job), True, None
        return *await anyio.to_thread.run_sync(self.enqueue, req, job, prep, recycled), None

    async def _enqueue_and_wait(self, job: JobRequest, job_id: str, wait_s: float) -> tuple[bool, bytes | None]:
        """The job's enqueue (Enqueuer.plain_commands, in MULTI/EXEC) and the first slice of JobReader.wait's
        (its XREAD and GET) written together on one blocking connection: Redis answers the transaction at once
        and the XREAD when the job ends, so a small job costs the API one write and one connection, not two.
        The transaction's error is raised as send_async raises it (the job was not enqueued); what follows is
        JobReader.wait's. wait_s > 0."""
        reader = self.reader
        deadline = anyio.current_time() + wait_s
        transaction = self.enqueuer.plain_commands(job, job_id)
        first = slice_commands(reader.prefix, job_id, min(wait_s, LEASE_CHECK_S))
        commands = [("MULTI",), *transaction, ("EXEC",), *first]
        async with Exchange(reader.ablocking, commands) as exchange:
            _raise_refused(await exchange.read(len(transaction) + 2, reader.redis_timeout_s))
            self.metrics.jobs_submitted.inc()  # enqueued: counted even if the wait then fails
            try:
                got, raw = await exchange.read(2, wait_s + reader.redis_timeout_s)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                raise unavailable(job_id, exc) from None
        if got:
            return True, await reader.load_result(raw, job_id)
        if wait_s <= LEASE_CHECK_S:
            return False, None
        return await reader.wait_until(job_id, deadline, reap_first=True)

    def prepare_inline(self, req: GradientRequest, body: bytes, key: str | None) -> Prepared | None:
        """The request validated on the event loop, when it can be checked and enqueued without a thread: a
        small layer spec, the shared queue (a device queue checks for live workers), one shard, no
        Idempotency-Key (a claim to make first) and no rate limit (a counter to bump); else None."""
        if req.run is not None and req.options.shards != 1:
            # A sharded job's result is made by its reduce job, which has no request to record a step from.
            raise ServiceError("bad_option", f"run {req.run.name!r}: a step of a run is one job, but options.shards="
                               f"{req.options.shards!r} splits it; send the step with shards=1 (the default)",
                               option="shards", run=req.run.name)
        if (small_layer_spec(req, body) and req.options.device == "auto" and req.options.shards == 1
                and key is None and self.auth.limit <= 0):
            chosen = self.limits.cached("auto") if self.limits is not None else None
            if self.limits is None or chosen is not None:  # the devices not read lately: a thread reads them
                return (chosen.engine if chosen else self.engine).prepare(req, "meta")
        return None

    def checker(self, device: str) -> tuple[Engine, EstimateLimits | None]:
        """The engine whose limits a request for options.device `device` is checked under (those of the workers
        its job may go to: service/device_limits.py), and what they are. Reads Redis when not cached: a thread."""
        if self.limits is None:
            return self.engine, None
        chosen = self.limits.for_device(device)
        return chosen.engine, chosen.limits

    def on_event_loop(self, prep: Prepared | None) -> bool:
        """Whether a request validated inline needs nothing else of Redis (a result too small to hand off
        needs no look at the workers), so it is enqueued over the async connection, with no thread hop."""
        return prep is not None and not self.enqueuer.queues.large_result(prep.gradient_bytes)

    def enqueue(self, req: GradientRequest, job: JobRequest, prep: Prepared | None = None,
                recycled: bool = False) -> tuple[str, bool]:
        """Validation and enqueue in one thread hop: (job id, whether it was enqueued now). A graph_ref is
        looked up among this owner's graphs (and its TTL refreshed) here; a graph sent whole is kept under
        its ref, for this owner, for the next request. `prep`: the request already validated on the event
        loop. `recycled`: the request released a result whose file's pages its body's file takes (Enqueuer.start)."""
        owner = job.owner
        early = self.enqueuer.start(job.body, req.options, job.key, recycled) if prep is None else None
        try:
            if prep is None:
                self.blobs.check(owner, req)
                engine, _ = self.checker(req.options.device)
                prep = engine.prepare(req, "meta", graphs=self.graphs.resolver(owner))
            self.auth.check_rate(owner)
            if prep.graph_data is not None:
                self.graphs.put(owner, prep.graph.ref, req.model.graph, prep.graph_data)
            sharded = (req, prep) if req.options.shards != 1 else None
            model_key = affinity.model_key(req, prep.graph.ref if prep.graph is not None else None)
            return self.enqueuer.enqueue_job(dataclasses.replace(job, sharded=sharded, early=early,
                                                                 result_bytes=prep.gradient_bytes,
                                                                 model_key=model_key))
        finally:
            if early is not None and early.staged is not None:
                early.staged.discard()  # a no-op once the enqueue committed it

    async def estimate(self, req: GradientRequest, body: bytes, owner: str) -> Estimate:
        """POST /estimate: the request's predicted memory, checked as POST /gradients checks it, under the limits
        of the workers its job would go to (which it names)."""
        chosen = self.limits.cached(req.options.device) if self.limits is not None else None
        if small_layer_spec(req, body) and (self.limits is None or chosen is not None):
            # as for POST /gradients: a spec seen before is a look-up (~0.1 ms)
            estimate = (chosen.engine if chosen else self.engine).estimate(req)
            return msgspec.structs.replace(estimate, limits=chosen.limits) if chosen else estimate
        return await anyio.to_thread.run_sync(self._checked_estimate, req, owner)

    def _checked_estimate(self, req: GradientRequest, owner: str) -> Estimate:
        self.blobs.check(owner, req)
        engine, limits = self.checker(req.options.device)
        estimate = engine.estimate(req, graphs=self.graphs.resolver(owner))
        return msgspec.structs.replace(estimate, limits=limits)  # the cached estimate itself is shared
