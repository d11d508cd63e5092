"""The worker's Prometheus metrics, declared once; each worker serves them on its own port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# From sub-millisecond forward passes of small nets to multi-minute numerical checks.
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
PHASES = ("queue_wait", "forward", "backward", "numcheck", "memory", "total")


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.phase = Histogram("gradsvc_job_phase_duration_seconds", "Time spent in each phase of a gradient job.",
                               ["phase", "device"], buckets=PHASE_BUCKETS, registry=self.registry)
        self.completed = Counter("gradsvc_jobs_completed_total", "Jobs this worker ended, by outcome and error code.",
                                 ["status", "device", "code"], registry=self.registry)
        self.saved_bytes = Histogram("gradsvc_activation_saved_bytes", "Activation bytes saved for backward per job.",
                                     buckets=tuple(4.0 ** k for k in range(4, 19)), registry=self.registry)
        self.numcheck_error = Histogram("gradsvc_numcheck_max_rel_error",
                                        "Largest relative error of the numerical check per job.",
                                        buckets=tuple(10.0 ** -k for k in range(16, -1, -1)), registry=self.registry)
        self.busy = Gauge("gradsvc_worker_busy", "1 while this worker runs a job.", registry=self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def observe_result(self, device: str, timings, memory, numcheck, queue_s: float) -> None:
        kind = device.split(":")[0]
        self.phase.labels("queue_wait", kind).observe(max(queue_s, 0.0))
        for phase in ("forward", "backward", "numcheck", "memory", "total"):
            self.phase.labels(phase, kind).observe(getattr(timings, f"{phase}_ms") / 1e3)
        if memory is not None:
            self.saved_bytes.observe(memory.saved_bytes_total)
        if numcheck is not None:
            self.numcheck_error.observe(numcheck.max_rel_error)
        self.completed.labels("finished", kind, "").inc()

    def observe_failure(self, device: str, code: str) -> None:
        self.completed.labels("failed", device.split(":")[0], code).inc()
