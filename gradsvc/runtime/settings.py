"""Settings: read once from GRADSVC_* environment variables at start-up and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping


class SettingsError(ValueError):
    """A GRADSVC_* variable holds a value that cannot be used; the message names it."""


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _rule(default: Any, ok: Callable[[Any], bool], advice: str) -> Any:
    """A setting's default and the rule its value must meet (Settings.validate checks every one, and says
    `advice` naming the variable when a value breaks it)."""
    return field(default=default, metadata={"ok": ok, "advice": advice})


def _positive(default: float) -> Any:
    return _rule(default, lambda v: v > 0, "must be positive")


def _at_least_zero(default: float, zero_means: str = "") -> Any:
    return _rule(default, lambda v: v >= 0, f"use 0{zero_means} or more")


def _one_of(default: str, choices: tuple[str, ...], advice: str) -> Any:
    return _rule(default, lambda v: v in choices, advice)


def host_memory_bytes() -> int:
    """This host's physical memory (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def default_krylov_bytes() -> int:
    """GRADSVC_MAX_KRYLOV_BYTES's default: a quarter of this host's memory (4 GiB where it cannot be read)."""
    return host_memory_bytes() // 4 or 4 << 30


def default_job_bytes() -> int:
    """GRADSVC_MAX_JOB_BYTES's default: half this host's memory (16 GiB where it cannot be read)."""
    return host_memory_bytes() // 2 or 16 << 30


# Fields not read from a variable of their own (Settings.from_env derives them).
DERIVED = ("redis_url_given", "limits_given")
# The limits a CUDA device's memory stands in for unless set (gradsvc.engine.config.DEVICE_LIMITS).
DEVICE_LIMITS = ("max_elements", "max_job_bytes")


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis Sentinel (gradsvc/broker/connection.py): "host:port,..." of the sentinels, and the name they
    # monitor the master under. Set, every connection goes to the master they name (GRADSVC_REDIS_URL then
    # gives only the db number and credentials).
    redis_sentinels: tuple[str, ...] = ()
    redis_sentinel_master: str = "gradsvc"
    host: str = "127.0.0.1"
    port: int = _positive(8000)
    api_keys: tuple[str, ...] = ()
    api_keys_file: str = ""
    queue_prefix: str = "gradsvc"
    # One body: since weights go up by reference in pieces (PUT /tensors), it caps a piece, not a model.
    max_body_bytes: int = _positive(256 * 1024 * 1024)
    # The bodies the API holds at once, by their sizes (a JSON body costs ~4x its size in memory while decoded):
    # past it a body is refused 503 server_busy (one body alone is always taken).
    max_bodies_bytes: int = _positive(1024 * 1024 * 1024)
    # The model a worker builds, weighs and differentiates: 200M admits the common first real models (GPT-2
    # small 124M, BERT-base 110M) with room, at 0.8 GB of float32 weights and as much again in gradients.
    max_parameters: int = _positive(200_000_000)
    max_elements: int = _positive(64_000_000)
    max_layers: int = _positive(512)
    max_depth: int = _positive(8)
    # Nodes in one graph model (its Functions' graphs included). The API checks a new graph on the meta
    # device, on a thread, at 50-600 us of CPU per node, by op (bench/graph_validation.py): 20,000 nodes take up
    # to 12 s for the costliest op measured (layer_norm), once per graph (later steps send its graph_ref). Real
    # models recorded as they run are that large: a 7,861-node one was refused at the earlier 5,000.
    max_graph_nodes: int = _positive(20_000)
    # An answer: the float32 gradients of a model at max_parameters (0.8 GB) fit, with room for the rest.
    max_result_bytes: int = _positive(1024 * 1024 * 1024)
    # The memory one job may use: the API's meta-device check of a graph refuses more (too_large, its
    # intermediates, attention matrices and the dense kernels' copies counted), and each CPU worker caps its
    # heap at what it held after warm-up plus this (RLIMIT_DATA): an allocation past it fails the job
    # out_of_memory and the worker goes on (workers/main.py caps it).
    max_job_bytes: int = field(default_factory=default_job_bytes,
                               metadata={"ok": lambda v: v > 0, "advice": "must be positive"})
    default_wait_s: float = 30.0
    max_wait_s: float = 300.0
    job_timeout_s: int = _positive(600)
    result_ttl_s: int = _positive(3600)
    failure_ttl_s: int = 86400
    # How long the API keeps a validated graph for `model.graph_ref` after its last use.
    graph_ttl_s: int = _positive(86400)
    # Tensors by reference (gradsvc/broker/blobs.py): how long an uploaded piece stays after its last use, the
    # bytes one owner's pieces may hold in Redis (the least recently used go first), and what each worker
    # keeps of the pieces it used.
    tensor_ttl_s: int = _positive(3600)
    tensor_budget_bytes: int = _positive(4 << 30)
    tensor_cache_bytes: int = 2 << 30
    # The refs (tensor pieces) one request may name: their check holds Redis ~2 us each (gradsvc/broker/blobs.py).
    max_refs: int = _positive(4096)
    # The models a worker keeps on its device between jobs with their weights in place (gradsvc/engine/resident.py):
    # a weight sent by the same reference as before is neither fetched nor copied again. -1: a share of the device's
    # memory (a quarter of a GPU's; an eighth of a CPU host's, split among its workers: engine/config.py says why).
    resident_model_bytes: int = _rule(-1, lambda v: v >= -1, "use -1 (a share of the device's memory), 0 (no model "
                                      "kept) or a number of bytes")
    # The float32 math of a job that does not set options.math_mode: "ieee" (full float32 convolutions and
    # matmuls: the same verdict on any device) or "tf32" (TF32 on CUDA devices that have it; never on a CPU).
    float32_math: str = _one_of("ieee", ("ieee", "tf32"), "use ieee or tf32")
    numcheck_exact_max: int = 20_000
    numcheck_directions: int = 16
    numcheck_samples: int = 8
    # numcheck "auto" runs the most thorough mode whose evaluations fit this many times the job's own
    # forward+backward, plus numcheck_budget_min_s (tiny jobs).
    numcheck_budget: float = _positive(10.0)
    numcheck_budget_min_s: float = _at_least_zero(0.25)
    workers: int = _positive(1)
    worker_metrics_port: int = 9101
    worker_device: str = _one_of("auto", ("auto", "cpu", "cuda"), "use auto, cpu or cuda")
    # A job's lease is 3 heartbeats: a killed worker's job fails worker_lost within about 8 s.
    worker_heartbeat_s: int = _positive(2)
    # A worker that dequeues a job from a shared queue takes up to this many queued there at once (gradsvc/broker/takes.py).
    worker_take: int = _positive(1)
    # Affinity (gradsvc/broker/affinity.py): how long a job of a model a worker holds may wait in that worker's own
    # queue before another worker's heartbeat (every 0.5 s) moves it to the shared queue.
    affinity_wait_ms: int = _at_least_zero(250)
    idempotency_ttl_s: int = _positive(86400)
    rate_limit_per_minute: int = _at_least_zero(0, " (off)")
    # Wrong keys one client address may try at /ui/login in a minute before it is refused 429 for the rest of it.
    login_failures_per_minute: int = _at_least_zero(10, " (off)")
    min_shard_rows: int = _positive(256)
    redis_timeout_s: float = _positive(2.0)
    # How long the API keeps an idle keep-alive connection open. It must outlast the clients' own idle
    # expiry (httpx and the SDK: 5 s), or a client may send its next request on a connection the server
    # is closing at that moment and get a connection reset instead of an answer (uvicorn's default is 5 s).
    keep_alive_s: float = _positive(75.0)
    # HTTP connections (service/http_server.py): a request's head in bytes and header lines (over either: 431,
    # before any key is checked), and how long an answer's unsent bytes may sit without one being read before
    # the connection is cut (a client that never reads a large result would hold it in memory for good).
    max_header_bytes: int = _positive(64 << 10)
    max_headers: int = _positive(100)
    write_timeout_s: float = _positive(30.0)
    log_level: str = _rule("info", lambda v: v.lower() in LOG_LEVELS, f"use one of {', '.join(LOG_LEVELS)}")
    # The probes (/healthz, /readyz) never ask for a key; /metrics does only when this is set.
    metrics_require_key: bool = False
    # The job page draws at most this many nodes of the grad_fn chain (the nearest the loss; the page says how
    # many it left out): the drawing's cost grows with its nodes, and a long recurrent chain has tens of thousands.
    page_graph_nodes: int = _positive(400)
    # /schema and /docs describe the API, no caller's data: open by default, so a client generator can read the
    # schema with keys on; set, they ask for a key (or the browser's session) like the other routes.
    docs_require_key: bool = False
    # Large bodies and results handed over as files when the API and the workers share a host
    # (gradsvc/broker/handoff.py): "" is off (standalone serve/worker, compose); `gradsvc up` sets a per-stack
    # dir under /dev/shm. Smaller payloads go through Redis as before.
    handoff_dir: str = ""
    handoff_min_bytes: int = _at_least_zero(1 << 20)
    # Training runs (docs/runs.md): the steps kept per run (the oldest go first), the runs kept per owner (the
    # least recently stepped go first), how long a run lives after its last step, and the largest model whose
    # weights a run keeps from one step to the next for the update ratio (a larger one records it as null).
    run_max_steps: int = _positive(10_000)
    run_max_runs: int = _positive(100)
    run_ttl_s: int = _positive(7 * 86400)
    run_weights_max_bytes: int = _at_least_zero(64 << 20, " (no update ratios)")
    # What /metrics exports of the runs: the most recently stepped runs (every owner's), the modules of each
    # (the first in the model's order), and only runs stepped within run_metrics_idle_s: an idle run's series go.
    run_metrics_runs: int = _at_least_zero(20, " (no run metrics)")
    run_metrics_modules: int = _at_least_zero(32)
    run_metrics_idle_s: int = _positive(900)
    # With API keys set, /metrics shows a scrape the runs of the key it sends (none without one); true shows every
    # key's runs to every scrape, as without keys (run names, losses and norms are the key holders' data).
    run_metrics_public: bool = False
    # A run's page draws at most this many cells in each module x step heatmap (every k-th step past it), and its
    # CSV or JSON answers at most run_export_max_cells values (steps x columns; past it 422 too_large, `last=` asks
    # for fewer steps): both are built off the event loop, and their size grows with steps x modules.
    run_page_cells: int = _positive(100_000)
    run_export_max_cells: int = _positive(4_000_000)
    # options.curvature's Lanczos basis: float64 vectors of the parameter count, one per iteration, held by the
    # worker until the run ends; a request whose iterations need more is refused before the queue (too_large).
    max_krylov_bytes: int = field(default_factory=default_krylov_bytes,
                                  metadata={"ok": lambda v: v > 0, "advice": "must be positive"})
    # The embedded Redis of `gradsvc up` (none at GRADSVC_REDIS_URL): its maxmemory, under noeviction, so a full
    # Redis refuses writes (503 redis_oom) rather than evict a job's records; 0 is no limit.
    embedded_redis_maxmemory_bytes: int = field(default_factory=default_krylov_bytes,
                                                metadata={"ok": lambda v: v >= 0, "advice": "must be >= 0 (0: no limit)"})
    # Training sessions (docs/sessions.md): how many one owner may hold and one worker may hold, how long an
    # unused session lives (its record, checkpoint and answers expire together), and how often its state is
    # checkpointed when POST /sessions does not say (0: from the state's size, docs/sessions.md).
    session_max_per_owner: int = _positive(8)
    session_max_per_worker: int = _positive(16)
    session_idle_ttl_s: int = _positive(3600)
    session_checkpoint_every: int = _at_least_zero(0, " (from the state's size)")
    # The bytes of the answers a session keeps for its remembered idempotency keys (its last 256): past it the
    # oldest keys are forgotten with their answers (the newest answer is always kept).
    session_answer_bytes: int = _positive(16 << 20)
    # How long a new session whose frozen base a worker already holds (and has room beside) waits in that worker's
    # own queue, the worker busy, before any worker may take it (and build the base again).
    session_base_wait_ms: int = _at_least_zero(5000)
    # A session over several workers (docs/sessions.md): how long one of its collectives (the rendezvous, an
    # all-reduce) may wait for the other members before the call fails member_lost, and the address this worker's
    # process groups listen on (another host's workers must reach it: set it to this host's address there).
    session_collective_timeout_s: float = _positive(60.0)
    worker_address: str = "127.0.0.1"
    # Derived, not read from a variable of its own: whether GRADSVC_REDIS_URL was set (`gradsvc up`
    # starts an embedded Redis when it was not).
    redis_url_given: bool = False
    # Derived: the limits set explicitly (GRADSVC_MAX_ELEMENTS, GRADSVC_MAX_JOB_BYTES, by field name); on CUDA
    # the others follow the device's memory (gradsvc.engine.config.limits_for_device, docs/limits.md).
    limits_given: frozenset = frozenset()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Settings":
        env = os.environ if environ is None else environ
        values: dict = {}
        values["redis_url_given"] = "GRADSVC_REDIS_URL" in env
        values["limits_given"] = frozenset(n for n in DEVICE_LIMITS if f"GRADSVC_{n.upper()}" in env or n in overrides)
        for f in fields(cls):
            var = f"GRADSVC_{f.name.upper()}"
            if var not in env or f.name in DERIVED:
                continue
            raw = env[var]
            try:
                values[f.name] = _parse(f.type, raw)
            except ValueError as exc:
                raise SettingsError(f"{var}={raw!r}: {exc}") from None
        values.update(overrides)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if "ok" in f.metadata and not f.metadata["ok"](value):
                raise SettingsError(f"GRADSVC_{f.name.upper()}={value!r}: {f.metadata['advice']}")
        if self.default_wait_s < 0 or self.max_wait_s < self.default_wait_s:
            raise SettingsError("GRADSVC_DEFAULT_WAIT_S must lie in [0, GRADSVC_MAX_WAIT_S]")
        if self.api_keys_file and not Path(self.api_keys_file).is_file():
            raise SettingsError(f"GRADSVC_API_KEYS_FILE={self.api_keys_file!r}: no such file")
        if self.handoff_dir and Path(self.handoff_dir).exists() and not Path(self.handoff_dir).is_dir():
            raise SettingsError(f"GRADSVC_HANDOFF_DIR={self.handoff_dir!r}: not a directory")
        for entry in self.redis_sentinels:
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise SettingsError(f"GRADSVC_REDIS_SENTINELS={','.join(self.redis_sentinels)!r}: {entry!r} is not "
                                    "host:port")
        if self.redis_sentinels and not self.redis_sentinel_master:
            raise SettingsError("GRADSVC_REDIS_SENTINEL_MASTER must name the master the sentinels monitor")

    @property
    def is_loopback_host(self) -> bool:
        return self.host in ("127.0.0.1", "::1", "localhost") or self.host.startswith("127.")

    def exposure_warning(self) -> str | None:
        """What the API says at start-up when it trusts every caller (no API keys), else None."""
        if self.all_api_keys():
            return None
        if self.is_loopback_host:
            return (f"no API keys configured (GRADSVC_API_KEYS): every caller is trusted; serving on {self.host} "
                    "only, so only this machine can reach the API")
        # Containers bind 0.0.0.0 and publish the port on the host's loopback; the API cannot see that.
        return (f"no API keys configured (GRADSVC_API_KEYS) and GRADSVC_HOST={self.host!r}: anyone who can reach "
                "this port can submit jobs and read every job; publish the port on loopback only, or set "
                "GRADSVC_API_KEYS")

    def all_api_keys(self) -> tuple[str, ...]:
        keys = list(self.api_keys)
        if self.api_keys_file:
            keys += [line.strip() for line in Path(self.api_keys_file).read_text().splitlines()
                     if line.strip() and not line.startswith("#")]
        return tuple(keys)


def _parse(kind, raw: str):
    kind = str(kind)
    if kind == "bool":
        if raw.strip().lower() in _TRUE:
            return True
        if raw.strip().lower() in _FALSE:
            return False
        raise ValueError(f"use one of {', '.join(_TRUE)} or {', '.join(v for v in _FALSE if v)}")
    if kind in ("int", "float"):
        try:
            return int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise ValueError(f"expected {'an integer' if kind == 'int' else 'a number'}") from None
    if kind.startswith("tuple"):
        return tuple(k.strip() for k in raw.split(",") if k.strip())
    return raw
