"""A decoded POST /gradients on its way to a job id: the checks that read Redis (tensor and graph refs, the
rate limit), validation on the meta device (an invalid spec never reaches the queue), the graph kept for the
next request, the enqueue; and which requests take that way on the event loop, without a thread hop."""

from __future__ import annotations

from dataclasses import dataclass

from gradsvc.broker import blobs as tensor_refs
from gradsvc.broker.blobs import BlobStore
from gradsvc.broker.graphs import GraphStore
from gradsvc.engine import Engine
from gradsvc.engine.prepare import Prepared
from gradsvc.wire import GradientRequest

from .auth import Auth
from .enqueue import Enqueuer
from .exceptions import ServiceError

# A body this small with a layer spec is validated on the event loop (a spec seen before: ~0.1 ms; a new
# one: a few ms, once), sparing the thread hop (bench/summary.py's small job).
_EVENT_LOOP_BODY_BYTES = 16 << 10


def small_layer_spec(req: GradientRequest, body: bytes) -> bool:
    """A body small enough to check on the event loop, of a layer spec (a graph may need a Redis look-up),
    with no tensor by reference (its pieces are looked up in Redis)."""
    return len(body) <= _EVENT_LOOP_BODY_BYTES and req.model.layers is not None and not tensor_refs.has_refs(req)


@dataclass(eq=False)
class Submitter:
    engine: Engine
    graphs: GraphStore
    blobs: BlobStore
    auth: Auth
    enqueuer: Enqueuer

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
            return self.engine.prepare(req, "meta")
        return None

    def on_event_loop(self, prep: Prepared | None) -> bool:
        """Whether a request validated inline needs nothing else of Redis (a result too small to hand off
        needs no look at the workers), so it is enqueued over the async connection, with no thread hop."""
        return prep is not None and not self.enqueuer.queues.large_result(prep.gradient_bytes)

    async def enqueue_async(self, body: bytes, fmt: str, owner: str) -> str:
        return await self.enqueuer.enqueue_async(body, fmt, owner)

    def enqueue(self, req: GradientRequest, body: bytes, fmt: str, owner: str, key: str | None,
                prep: Prepared | None = None, key_age_s: float | None = None,
                recycled: bool = False) -> tuple[str, bool]:
        """Validation and enqueue in one thread hop: (job id, whether it was enqueued now). A graph_ref is
        looked up among this owner's graphs (and its TTL refreshed) here; a graph sent whole is kept under
        its ref, for this owner, for the next request. `prep`: the request already validated on the event
        loop. `recycled`: the request released a result whose file's pages its body's file takes (Enqueuer.start)."""
        early = self.enqueuer.start(body, req.options, key, recycled) if prep is None else None
        try:
            if prep is None:
                self.blobs.check(owner, req)
                prep = self.engine.prepare(req, "meta", graphs=self.graphs.resolver(owner))
            self.auth.check_rate(owner)
            if prep.graph_data is not None:
                self.graphs.put(owner, prep.graph.ref, req.model.graph, prep.graph_data)
            sharded = (req, prep) if req.options.shards != 1 else None
            return self.enqueuer.enqueue(body, fmt, req.options.device, owner, key, sharded=sharded,
                                         result_bytes=prep.gradient_bytes, key_age_s=key_age_s, early=early)
        finally:
            if early is not None and early.staged is not None:
                early.staged.discard()  # a no-op once the enqueue committed it
