"""The limits a request is validated under: those of the workers its job may go to. The API has no GPU; each
worker publishes its device (kind, name, memory) in Redis with its heartbeat (gradsvc/broker/devices.py), and
on CUDA the element and memory limits not set explicitly follow the device's memory
(gradsvc.engine.config.limits_for_device). Decided per device class, trusted for CACHE_S (docs/limits.md):

    options.device  the workers a job may go to    the limits
    cuda            the cuda queue's               the smallest live CUDA device's
    cpu             the cpu queue's                the settings'
    auto            the shared queue's: every one  the smallest CUDA device's when every live worker has one,
                                                   else the settings' (a CPU worker may take the job)

With no live worker that published a device, the settings' hold (the job waits for a worker anyway)."""

from __future__ import annotations

import dataclasses
import threading
import time

from redis.exceptions import RedisError

from gradsvc.broker import devices, keys
from gradsvc.broker.devices import WorkerDevice
from gradsvc.engine import Engine
from gradsvc.engine.config import limits_for_device
from gradsvc.wire import EstimateLimits

# How long the devices read from Redis are trusted: a worker that joins with a larger card is seen within it.
CACHE_S = 5.0


@dataclasses.dataclass(frozen=True)
class Chosen:
    """The engine whose limits a request is checked under, and what the limits came from."""

    engine: Engine
    limits: EstimateLimits


class DeviceLimits:
    """Each device class's limits and an Engine per distinct limits (the engine's caches are keyed by what they
    checked under one Engine's limits, so each set of limits has its own), read from Redis in a thread, on the
    event loop only from the cache (`cached`)."""

    def __init__(self, engine: Engine, redis, prefix: str, given: frozenset = frozenset()) -> None:
        self.base = engine  # the settings' limits
        self.redis, self.prefix, self.given = redis, prefix, given
        self._engines = {engine.config.limits: engine}
        self._chosen: dict[str, tuple[float, Chosen]] = {}
        self._lock = threading.Lock()

    def cached(self, device: str) -> Chosen | None:
        """The limits for `device` if read within CACHE_S, else None (the caller goes to a thread)."""
        hit = self._chosen.get(device)
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def for_device(self, device: str) -> Chosen:
        """The limits for options.device `device`, read from Redis when the cache is stale (blocking)."""
        hit = self.cached(device)
        if hit is not None:
            return hit
        queue = keys.queue_name(self.prefix, device)
        try:
            live = devices.live_devices(self.redis, self.prefix, queue)
        except RedisError:
            # Redis out: the settings' limits, not kept; the request is still checked (a bad one is its 4xx), and
            # its enqueue answers 503 if Redis is still out then
            return Chosen(self.base, self._described(self.base, "settings"))
        chosen = self._choose(device, live)
        self._chosen[device] = (time.monotonic() + CACHE_S, chosen)
        return chosen

    def _choose(self, device: str, live: list[WorkerDevice]) -> Chosen:
        cuda = [d for d in live if d.kind == "cuda"]
        if device == "cpu" or not cuda or len(cuda) < len(live):
            return Chosen(self.base, self._described(self.base, "cpu" if device == "cpu" or live else "settings"))
        smallest = min(cuda, key=lambda d: d.total_bytes)
        limits = limits_for_device(self.base.config.limits, smallest.total_bytes, self.given)
        with self._lock:
            engine = self._engines.get(limits)
            if engine is None:
                engine = self._engines[limits] = Engine(dataclasses.replace(self.base.config, limits=limits))
        return Chosen(engine, self._described(engine, "cuda", smallest))

    @staticmethod
    def _described(engine: Engine, device: str, card: WorkerDevice | None = None) -> EstimateLimits:
        limits = engine.config.limits
        return EstimateLimits(device=device, device_name=card.name if card else None,
                              device_bytes=card.total_bytes if card else None, max_elements=limits.max_elements,
                              max_job_bytes=limits.max_graph_intermediate_bytes,
                              max_parameters=limits.max_parameters)
