"""The API's Redis connections and RQ queues: the shared queue of each device, its handoff domain's twin,
and which of the two a job goes to."""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry
from rq import Queue

from gradsvc.broker import handoff as handoff_files
from gradsvc.broker import keys
from gradsvc.broker.affinity import Mover
from gradsvc.broker.connection import connect, connect_async
from gradsvc.broker.handoff import Handoff
from gradsvc.broker.job import GradientJob, MsgpackSerializer
from gradsvc.runtime.settings import Settings

from .epochs import Epochs

# How long the API trusts its last look at which workers serve a queue (whether all are in its domain).
ROUTE_CACHE_S = 1.0


@dataclass(frozen=True)
class JobRecord:
    """What every job of the API carries beyond its argument: RQ's TTLs, and the owner's recent-jobs index."""

    prefix: str
    timeout_s: int
    result_ttl_s: int
    failure_ttl_s: int
    affinity_wait_s: float = 0.25  # how long a job may wait in a holder's own queue (GRADSVC_AFFINITY_WAIT_MS)

    @classmethod
    def from_settings(cls, settings: Settings) -> "JobRecord":
        return cls(settings.queue_prefix, settings.job_timeout_s, settings.result_ttl_s, settings.failure_ttl_s,
                   settings.affinity_wait_ms / 1e3)

    @property
    def index_ttl_s(self) -> int:
        return max(self.result_ttl_s, self.failure_ttl_s)


class Queues:
    """`redis` (sync, for threads), `aredis` (the event loop's), `ablocking` (blocking XREADs), the RQ queues
    `shared[device]` and `domain[device]` (empty with the handoff off), the `handoff` and Redis's `epochs`."""

    def __init__(self, settings: Settings) -> None:
        self.prefix = settings.queue_prefix
        # Short timeouts and one immediate retry on a connection error only (never on a timeout): a pooled
        # connection that a Redis restart left dead is replaced at once, and with Redis down or hung the API
        # still answers 503 within about GRADSVC_REDIS_TIMEOUT_S.
        timeout = settings.redis_timeout_s
        self.redis = connect(settings, socket_connect_timeout=timeout, socket_timeout=timeout,
                             retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self.aredis = connect_async(settings, socket_connect_timeout=timeout, socket_timeout=timeout,
                                    retry=AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        # Blocking XREADs last up to max_wait_s, so they get their own pool whose socket timeout outlasts them;
        # JobReader.wait() bounds each one by its own deadline, so a hung Redis still answers 503 soon after it.
        self.ablocking = connect_async(settings, socket_connect_timeout=timeout,
                                       socket_timeout=settings.max_wait_s + timeout + 5,
                                       retry=AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self.replicated = bool(settings.redis_sentinels)  # Sentinel: an enqueue waits for a replica (Enqueuer)
        self.shared = {d: self._queue(keys.queue_name(self.prefix, d)) for d in keys.QUEUE_DEVICES}
        # GRADSVC_HANDOFF_DIR: large bodies go to a file and their jobs to this domain's queues
        # (gradsvc/broker/handoff.py), as long as every live worker of the device drains them.
        self.handoff: Handoff | None = handoff_files.open_dir(settings.handoff_dir, settings.handoff_min_bytes)
        handoff_files.bind(self.redis, self.handoff)  # for a shard's failure callback run by this process (a reap)
        # tmpfs pages kept for the next large body's file (handoff.Spare), deleted by close()
        self.spare = handoff_files.Spare(self.handoff) if self.handoff is not None else None
        self.domain = {} if self.handoff is None else {
            d: self._queue(keys.domain_queue_name(self.prefix, d, self.handoff.domain)) for d in keys.QUEUE_DEVICES}
        self._routes: dict[str, tuple[float, bool]] = {}
        self.mover = Mover(self.redis, self.prefix)  # tracks the jobs routed to a worker's own queue
        self.epochs = Epochs(self.redis, self.prefix)

    def own(self, queue_name: str) -> Queue:
        """A worker's own queue (gradsvc/broker/affinity.py route)."""
        return self._queue(queue_name)

    def _queue(self, name: str) -> Queue:
        return Queue(name, connection=self.redis, serializer=MsgpackSerializer, job_class=GradientJob)

    async def close(self) -> None:
        await self.aredis.aclose()
        await self.ablocking.aclose()
        self.redis.close()
        if self.spare is not None:
            self.spare.drop()
        if self.handoff is not None:
            self.handoff.close()

    def large_result(self, result_bytes: int) -> bool:
        """Whether a job with a result this large may be handed off (then it is enqueued from a thread, since
        deciding reads Redis: handoff_ok)."""
        return self.handoff is not None and self.handoff.wanted(result_bytes)

    def handoff_wanted(self, device: str, body_bytes: int, result_bytes: int) -> bool:
        """Whether a job goes through the handoff domain's queue: the handoff is on, its body or its result
        is large enough, and every live worker of the device is in the domain."""
        return (self.handoff is not None and (self.handoff.wanted(body_bytes) or self.handoff.wanted(result_bytes))
                and self.handoff_ok(device))

    def handoff_ok(self, device: str) -> bool:
        """Whether every live worker that drains `device`'s queue drains this domain's twin of it too, so a
        job sent there starves no one: RQ's per-queue worker sets, one round trip (a second one only when
        they differ, to skip workers that died without unregistering), trusted for ROUTE_CACHE_S."""
        now = time.monotonic()
        cached = self._routes.get(device)
        if cached is not None and cached[0] > now:
            return cached[1]
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(keys.rq_queue_workers_key(self.shared[device].name))
            pipe.smembers(keys.rq_queue_workers_key(self.domain[device].name))
            plain, domain = pipe.execute()
        others = sorted(plain - domain)
        if others:  # workers outside the domain, or entries of dead ones: count only those alive
            with self.redis.pipeline(transaction=False) as pipe:
                for worker_key in others:
                    pipe.exists(worker_key)
                others = [k for k, alive in zip(others, pipe.execute()) if alive]
        ok = bool(domain) and not others
        self._routes[device] = (now + ROUTE_CACHE_S, ok)
        return ok

    def sweep_handoff(self, result_ttl_s: int, failure_ttl_s: int) -> int:
        """Deletes the handoff files that outlived their TTL (gradsvc.broker.handoff.sweep_ages); the app runs it
        once a minute in a thread, as each worker does after its jobs."""
        if self.handoff is None:
            return 0
        return self.handoff.sweep(handoff_files.sweep_ages(result_ttl_s, failure_ttl_s))
