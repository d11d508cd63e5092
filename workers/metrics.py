"""The worker's Prometheus metrics, declared once; each worker serves them on its own port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# From the ~0.1 ms forward pass of a small net to a numerical check that runs into minutes
# (GRADSVC_JOB_TIMEOUT_S defaults to 600 s, the last finite bucket).
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
PHASES = ("queue_wait", "forward", "backward", "numcheck", "memory", "total")
# 256 B to 64 GiB in factors of 4: a toy net's few hundred bytes up to a GPU's whole memory.
SAVED_BYTES_BUCKETS = tuple(4.0 ** k for k in range(4, 19))
# 1e-16 (float64 round-off) to 1; the check's default tolerance 1e-6 is a bucket edge.
REL_ERROR_BUCKETS = tuple(10.0 ** -k for k in range(16, -1, -1))


def device_kind(device: str) -> str:
    """The device label: `cuda:1` reads `cuda`, so it stays bounded however many GPUs a machine has."""
    return device.split(":")[0]


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.phase = Histogram("gradsvc_job_phase_duration_seconds", "Time spent in each phase of a gradient job.",
                               ["phase", "device"], buckets=PHASE_BUCKETS, registry=self.registry)
        # kind: "job" (a whole request), "shard" (one shard of a sharded request) or "reduce" (the job that
        # combines a sharded request's shards: one per sharded request, so job + reduce counts requests).
        self.completed = Counter("gradsvc_jobs_completed_total",
                                 "Jobs this worker ended, by outcome, error code (empty when finished) and kind.",
                                 ["status", "device", "code", "kind"], registry=self.registry)
        self.saved_bytes = Histogram("gradsvc_activation_saved_bytes", "Activation bytes saved for backward per job.",
                                     buckets=SAVED_BYTES_BUCKETS, registry=self.registry)
        self.numcheck_error = Histogram("gradsvc_numcheck_max_rel_error",
                                        "Largest relative error of the numerical check per job.",
                                        buckets=REL_ERROR_BUCKETS, registry=self.registry)
        self.busy = Gauge("gradsvc_worker_busy", "1 while this worker runs a job.", registry=self.registry)
        self.tensor_cache_bytes = Gauge("gradsvc_tensor_cache_bytes", "Bytes of tensor pieces this worker keeps "
                                        "(GRADSVC_TENSOR_CACHE_BYTES).", registry=self.registry)
        self.tensor_cache_hits = Counter("gradsvc_tensor_cache_hits_total", "Tensor pieces found in this worker's "
                                         "cache.", registry=self.registry)
        self.tensor_cache_misses = Counter("gradsvc_tensor_cache_misses_total", "Tensor pieces fetched from Redis.",
                                           registry=self.registry)
        self.resident_model_bytes = Gauge("gradsvc_resident_model_bytes", "Bytes of the models this worker keeps "
                                          "on its device with their weights in place (GRADSVC_RESIDENT_MODEL_BYTES).",
                                          registry=self.registry)
        self.resident_hits = Counter("gradsvc_resident_model_hits_total", "Jobs whose model this worker held.",
                                     registry=self.registry)
        self.resident_misses = Counter("gradsvc_resident_model_misses_total", "Jobs whose model this worker built.",
                                       registry=self.registry)
        self.resident_evictions = Counter("gradsvc_resident_model_evictions_total", "Models this worker let go to "
                                          "stay within its resident bytes (or to free memory after running out).",
                                          registry=self.registry)
        # Training sessions (docs/sessions.md): what this worker holds, and the operations it ran on them.
        self.sessions_held = Gauge("gradsvc_sessions_held", "Training sessions this worker holds on its device.",
                                   registry=self.registry)
        self.session_bytes = Gauge("gradsvc_session_state_bytes", "Bytes of the training sessions' state (weights, "
                                   "buffers, optimizer state, gradients) this worker holds.", registry=self.registry)
        self.session_steps = Counter("gradsvc_session_operations_total", "Operations on training sessions this "
                                     "worker ran, by operation (step, forward_backward, optim_step, ...).",
                                     ["operation"], registry=self.registry)
        self.member_phase = Histogram("gradsvc_session_member_seconds", "A session over several workers: this "
                                      "member's part of each pass, by phase (compute: its rows' forward and "
                                      "backward; allreduce: the gradients' all-reduce, its wait for the slowest "
                                      "member included).", ["phase"], buckets=PHASE_BUCKETS, registry=self.registry)
        self._cache_seen = (0, 0)
        self._resident_seen = (0, 0, 0)

    def observe_resident(self, pool) -> None:
        """The resident pool's bytes, and its hits, misses and evictions since the last call."""
        now = (pool.hits, pool.misses, pool.evictions)
        for counter, value, seen in zip((self.resident_hits, self.resident_misses, self.resident_evictions), now,
                                        self._resident_seen):
            counter.inc(max(0, value - seen))
        self._resident_seen = now
        self.resident_model_bytes.set(pool.bytes)

    def observe_tensor_cache(self, cache) -> None:
        """The cache's bytes, and its hits and misses since the last call."""
        hits, misses = cache.hits, cache.misses
        self.tensor_cache_hits.inc(hits - self._cache_seen[0])
        self.tensor_cache_misses.inc(misses - self._cache_seen[1])
        self._cache_seen = (hits, misses)
        self.tensor_cache_bytes.set(cache.bytes)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def observe_result(self, device: str, timings, memory, numcheck, queue_s: float, kind: str = "job") -> None:
        dev = device_kind(device)
        if kind == "reduce":  # its shards observed their own phases, memory and checks
            self.completed.labels("finished", dev, "", kind).inc()
            return
        self.phase.labels("queue_wait", dev).observe(max(queue_s, 0.0))
        # A phase that did not run (numcheck off, memory off) is not observed: zeros would drag its percentiles.
        checked = numcheck is not None and numcheck.mode != "off"
        ran = {"forward": True, "backward": True, "numcheck": checked, "memory": memory is not None, "total": True}
        for phase, did_run in ran.items():
            if did_run:
                self.phase.labels(phase, dev).observe(getattr(timings, f"{phase}_ms") / 1e3)
        if memory is not None:
            self.saved_bytes.observe(memory.saved_bytes_total)
        if checked:
            self.numcheck_error.observe(numcheck.max_rel_error)
        self.completed.labels("finished", dev, "", kind).inc()

    def observe_failure(self, device: str, code: str, kind: str = "job") -> None:
        # The same status a client reads from GET /jobs/{id}: a canceled job is "canceled", not "failed".
        status = "canceled" if code == "canceled" else "failed"
        self.completed.labels(status, device_kind(device), code, kind).inc()
