"""The API's Prometheus metrics, declared once: requests by route template, jobs submitted, and
queue depth / workers by state and the training runs' gauges, read from Redis when /metrics is scraped (not per
request). The runs' gauges come from the API, not the workers: any worker records a run's step, and every API
process reads the same Redis, so each scrape sees every run whichever worker took its last step."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from gradsvc.broker.runs import RunStore
    from gradsvc.runtime.settings import Settings

    from .job_reader import JobReader

# API latencies: sub-millisecond validation answers up to long synchronous waits.
# The status label of a request whose client closed the connection before its answer started (nginx's 499).
CLIENT_CLOSED = 499
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _RedisCollector:
    def __init__(self, reader: "JobReader") -> None:
        self.reader = reader

    def collect(self):
        depth = GaugeMetricFamily("gradsvc_queue_depth", "Jobs waiting in each queue.", labels=["queue"])
        workers = GaugeMetricFamily("gradsvc_workers", "Live workers by state.", labels=["state"])
        try:
            for name, n in self.reader.queue_depths().items():
                depth.add_metric([name], n)
            counts = {"idle": 0, "busy": 0, "suspended": 0}
            for w in self.reader.workers():
                state = w.get_state()
                state = getattr(state, "value", state)
                # RQ's "started" is a worker booting before its first dequeue: it runs no job, so idle.
                counts[state if state in counts else "idle"] += 1
            for state, n in counts.items():
                workers.add_metric([state], n)
        except Exception:  # Redis down: export nothing rather than fail the scrape
            pass
        yield depth
        yield workers


_RUN_GAUGES = (
    ("gradsvc_run_loss", "The loss of a training run's last step."),
    ("gradsvc_run_gradient_norm", "The global L2 norm of the batch gradient at a run's last step (before clipping)."),
    ("gradsvc_run_noise_scale", "The gradient noise scale B_simple at a run's last step (options.diagnostics)."),
    ("gradsvc_run_step", "The number of a run's last recorded step."),
    ("gradsvc_run_check_passed", "1 when the numerical check of a run's last step passed, 0 when it failed."),
)
_RUN_MODULE_GAUGES = (
    ("gradsvc_run_module_gradient_norm", "The L2 norm of one module's gradient at a run's last step."),
    ("gradsvc_run_update_ratio", "|w_t - w_(t-1)| / |w_(t-1)| of one module's weights at a run's last step."),
)


class _RunCollector:
    """The last step of the most recently stepped runs (GRADSVC_RUN_METRICS_RUNS, each with at most
    GRADSVC_RUN_METRICS_MODULES modules); a run idle for GRADSVC_RUN_METRICS_IDLE_S is no longer exported, so
    its series end. Labelled by run name and owner (the first 8 hex digits of the key's digest, never the key):
    two keys may name runs alike."""

    def __init__(self, runs: "RunStore", settings: "Settings") -> None:
        self.runs = runs
        self.limit, self.modules, self.idle_s = (settings.run_metrics_runs, settings.run_metrics_modules,
                                                 settings.run_metrics_idle_s)

    def collect(self, owner: str | None = None):
        """The runs' families: every owner's runs, or `owner`'s alone."""
        run = {name: GaugeMetricFamily(name, doc, labels=["run", "owner"]) for name, doc in _RUN_GAUGES}
        per_module = {name: GaugeMetricFamily(name, doc, labels=["run", "owner", "module"])
                      for name, doc in _RUN_MODULE_GAUGES}
        try:
            exported = self.runs.exported(self.limit, self.idle_s, owner)
        except Exception:  # Redis down: export nothing rather than fail the scrape
            exported = []
        for entry in exported:
            last, labels = entry.last, [entry.name, entry.owner[:8]]
            run["gradsvc_run_loss"].add_metric(labels, last.loss)
            run["gradsvc_run_gradient_norm"].add_metric(labels, last.grad_norm)
            run["gradsvc_run_step"].add_metric(labels, last.step)
            if last.noise_scale is not None:
                run["gradsvc_run_noise_scale"].add_metric(labels, last.noise_scale)
            if last.numcheck is not None and last.numcheck.passed is not None:  # absent: the check did not run
                run["gradsvc_run_check_passed"].add_metric(labels, float(last.numcheck.passed))
            for module in list(last.module_grad_norms)[:self.modules]:
                per_module["gradsvc_run_module_gradient_norm"].add_metric([*labels, module],
                                                                          last.module_grad_norms[module])
                if last.update_ratio and module in last.update_ratio:
                    per_module["gradsvc_run_update_ratio"].add_metric([*labels, module], last.update_ratio[module])
        yield from run.values()
        yield from per_module.values()


class _ConnectionCollector:
    """What service/http_server.py refused or cut, by reason (it counts them: it runs below the app)."""

    def collect(self):
        from .http_server import CLOSED

        closed = CounterMetricFamily("gradsvc_http_connections_closed", "HTTP connections the API refused or cut: "
                                     "headers_too_large (431), stalled_reader (GRADSVC_WRITE_TIMEOUT_S).",
                                     labels=["reason"])
        for reason, n in CLOSED.items():
            closed.add_metric([reason], n)
        yield closed


class _RunsOf:
    """The run collector's families for one owner (None: every owner's), as generate_latest reads a registry."""

    def __init__(self, collector: _RunCollector, owner: str | None) -> None:
        self.collector, self.owner = collector, owner

    def collect(self):
        return self.collector.collect(self.owner)


EVERY_OWNER = "*"  # ApiMetrics.exposition: every owner's runs (a keyless deployment, or GRADSVC_RUN_METRICS_PUBLIC)


class ApiMetrics:
    def __init__(self, reader: "JobReader", runs: "RunStore | None" = None,
                 settings: "Settings | None" = None) -> None:
        self.registry = CollectorRegistry()
        self._series: dict[tuple[str, str, int], tuple] = {}  # _children's
        self.requests = Counter("gradsvc_http_requests_total", "HTTP requests by route template and status.",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("gradsvc_http_request_duration_seconds", "HTTP request latency by route template.",
                                 ["method", "route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.jobs_submitted = Counter("gradsvc_jobs_submitted_total", "Jobs accepted onto the queue.",
                                      registry=self.registry)
        self.results_released = Counter("gradsvc_results_released_total",
                                        "Results dropped before their TTL at their owner's request "
                                        "(Gradsvc-Release-Results).", registry=self.registry)
        self.tensor_uploads = Counter("gradsvc_tensor_uploads_total", "Tensor pieces uploaded (PUT /tensors).",
                                      registry=self.registry)
        self.tensor_upload_bytes = Counter("gradsvc_tensor_upload_bytes_total", "Bytes of tensor pieces uploaded.",
                                           registry=self.registry)
        self.tensor_evictions = Counter("gradsvc_tensor_evictions_total",
                                        "Tensor pieces evicted by an owner's byte budget (GRADSVC_TENSOR_BUDGET_BYTES).",
                                        registry=self.registry)
        self.redis_refusals = Counter("gradsvc_redis_refusals_total",
                                      "Requests answered 503 because Redis refused a write, by the code answered "
                                      "(redis_oom, redis_readonly, redis_unavailable).", ["code"],
                                      registry=self.registry)
        for code in ("redis_oom", "redis_readonly", "redis_unavailable"):
            self.redis_refusals.labels(code)  # exported at 0 from the start, as Prometheus advises for known labels
        self.registry.register(_RedisCollector(reader))
        self.registry.register(_ConnectionCollector())
        # The runs' gauges are their owners' data: not in the registry, added per scrape by `exposition`.
        self.run_collector = _RunCollector(runs, settings) if runs is not None and settings is not None else None

    def exposition(self, runs_of: str | None) -> bytes:
        """/metrics' text: every metric, and the runs' gauges of `runs_of` (an owner id; EVERY_OWNER; None: no
        run's gauges)."""
        text = generate_latest(self.registry)
        if self.run_collector is not None and runs_of is not None:
            text += generate_latest(_RunsOf(self.run_collector, None if runs_of == EVERY_OWNER else runs_of))
        return text

    def _children(self, method: str, route: str, status: int) -> tuple:
        """The request counter's and the latency histogram's series of a request: looked up once per label
        set (prometheus_client's labels() checks and locks on every call)."""
        got = self._series.get((method, route, status))
        if got is None:
            got = self._series[method, route, status] = (self.requests.labels(method, route, str(status)),
                                                         self.latency.labels(method, route))
        return got

    def middleware(self, app):
        """ASGI middleware: times each HTTP request, labelled by Litestar's route template. A request whose
        client went away before its answer started (mid-body, or while it waited for its job) is counted
        under 499, nginx's "client closed request", not under whatever the app then tried to send."""

        async def wrapped(scope, receive, send):
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            start = time.perf_counter()
            state = {"status": 500, "started": False, "gone": False}
            watcher: asyncio.Task | None = None

            def seen(message) -> None:
                if message["type"] == "http.disconnect" and not state["started"]:
                    state["gone"] = True

            async def watch():
                message = await receive()
                seen(message)
                return message

            async def receive_wrapper():
                nonlocal watcher
                if watcher is not None:  # the body is read: what comes next is the watcher's message
                    return await asyncio.shield(watcher)
                message = await receive()
                seen(message)
                if message["type"] == "http.request" and not message.get("more_body", False):
                    # The whole body is in: the next message can only be the client leaving (or, after the
                    # answer, the server's own end of the cycle), so listen for it while the handler waits.
                    watcher = asyncio.get_running_loop().create_task(watch())
                return message

            async def send_wrapper(message):
                if message["type"] == "http.response.start":
                    state["status"], state["started"] = message["status"], True
                await send(message)

            try:
                await app(scope, receive_wrapper, send_wrapper)
            finally:
                if watcher is not None and not watcher.done():
                    watcher.cancel()
                route = scope.get("path_template") or "unmatched"
                status = CLIENT_CLOSED if state["gone"] else state["status"]
                counted, timed = self._children(scope["method"], route, status)
                counted.inc()
                timed.observe(time.perf_counter() - start)

        return wrapped
