"""Settings: read once from GRADSVC_* environment variables at start-up and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping


class SettingsError(ValueError):
    """A GRADSVC_* variable holds a value that cannot be used; the message names it."""


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis Sentinel (gradsvc/broker/connection.py): "host:port,..." of the sentinels, and the name they
    # monitor the master under. Set, every connection goes to the master they name (GRADSVC_REDIS_URL then
    # gives only the db number and credentials).
    redis_sentinels: tuple[str, ...] = ()
    redis_sentinel_master: str = "gradsvc"
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    api_keys_file: str = ""
    queue_prefix: str = "gradsvc"
    max_body_bytes: int = 256 * 1024 * 1024
    max_parameters: int = 100_000_000
    max_elements: int = 64_000_000
    max_layers: int = 512
    max_depth: int = 8
    # Nodes in one graph model (its Functions' graphs included). The API checks a new graph on the meta
    # device at 50-600 us of CPU per node, by op (bench/graph_validation.py): 5,000 nodes stay within ~3 s
    # for the costliest op measured (layer_norm), where 20,000 took 12 s.
    max_graph_nodes: int = 5_000
    max_result_bytes: int = 512 * 1024 * 1024
    default_wait_s: float = 30.0
    max_wait_s: float = 300.0
    job_timeout_s: int = 600
    result_ttl_s: int = 3600
    failure_ttl_s: int = 86400
    # How long the API keeps a validated graph for `model.graph_ref` after its last use.
    graph_ttl_s: int = 86400
    # Tensors by reference (gradsvc/broker/blobs.py): how long an uploaded piece stays after its last use, the
    # bytes one owner's pieces may hold in Redis (the least recently used go first), and what each worker
    # keeps of the pieces it used.
    tensor_ttl_s: int = 3600
    tensor_budget_bytes: int = 4 << 30
    tensor_cache_bytes: int = 2 << 30
    numcheck_exact_max: int = 20_000
    numcheck_directions: int = 16
    numcheck_samples: int = 8
    # numcheck "auto" runs the most thorough mode whose evaluations fit this many times the job's own
    # forward+backward, plus numcheck_budget_min_s (tiny jobs).
    numcheck_budget: float = 10.0
    numcheck_budget_min_s: float = 0.25
    workers: int = 1
    worker_metrics_port: int = 9101
    worker_device: str = "auto"
    # A job's lease is 3 heartbeats: a killed worker's job fails worker_lost within about 8 s.
    worker_heartbeat_s: int = 2
    idempotency_ttl_s: int = 86400
    rate_limit_per_minute: int = 0
    min_shard_rows: int = 256
    redis_timeout_s: float = 2.0
    # How long the API keeps an idle keep-alive connection open. It must outlast the clients' own idle
    # expiry (httpx and the SDK: 5 s), or a client may send its next request on a connection the server
    # is closing at that moment and get a connection reset instead of an answer (uvicorn's default is 5 s).
    keep_alive_s: float = 75.0
    log_level: str = "info"
    # The probes (/healthz, /readyz) never ask for a key; /metrics does only when this is set.
    metrics_require_key: bool = False
    # Large bodies and results handed over as files when the API and the workers share a host
    # (gradsvc/broker/handoff.py): "" is off (standalone serve/worker, compose); `gradsvc up` sets a per-stack
    # dir under /dev/shm. Smaller payloads go through Redis as before.
    handoff_dir: str = ""
    handoff_min_bytes: int = 1 << 20
    # Derived, not read from a variable of its own: whether GRADSVC_REDIS_URL was set (`gradsvc up`
    # starts an embedded Redis when it was not).
    redis_url_given: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Settings":
        env = os.environ if environ is None else environ
        values: dict = {}
        values["redis_url_given"] = "GRADSVC_REDIS_URL" in env
        for f in fields(cls):
            var = f"GRADSVC_{f.name.upper()}"
            if var not in env or f.name == "redis_url_given":
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
        positive = ["port", "max_body_bytes", "max_parameters", "max_elements", "max_layers", "max_depth",
                    "max_graph_nodes", "max_result_bytes", "job_timeout_s", "result_ttl_s", "workers",
                    "redis_timeout_s", "worker_heartbeat_s", "min_shard_rows", "idempotency_ttl_s",
                    "graph_ttl_s", "keep_alive_s", "numcheck_budget", "tensor_ttl_s", "tensor_budget_bytes"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"GRADSVC_{name.upper()}={getattr(self, name)!r}: must be positive")
        if self.default_wait_s < 0 or self.max_wait_s < self.default_wait_s:
            raise SettingsError("GRADSVC_DEFAULT_WAIT_S must lie in [0, GRADSVC_MAX_WAIT_S]")
        if self.worker_device not in ("auto", "cpu", "cuda"):
            raise SettingsError(f"GRADSVC_WORKER_DEVICE={self.worker_device!r}: use auto, cpu or cuda")
        if self.api_keys_file and not Path(self.api_keys_file).is_file():
            raise SettingsError(f"GRADSVC_API_KEYS_FILE={self.api_keys_file!r}: no such file")
        if self.log_level.lower() not in LOG_LEVELS:
            raise SettingsError(f"GRADSVC_LOG_LEVEL={self.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
        if self.handoff_min_bytes < 0:
            raise SettingsError(f"GRADSVC_HANDOFF_MIN_BYTES={self.handoff_min_bytes!r}: use 0 or more")
        if self.handoff_dir and Path(self.handoff_dir).exists() and not Path(self.handoff_dir).is_dir():
            raise SettingsError(f"GRADSVC_HANDOFF_DIR={self.handoff_dir!r}: not a directory")
        if self.numcheck_budget_min_s < 0:
            raise SettingsError(f"GRADSVC_NUMCHECK_BUDGET_MIN_S={self.numcheck_budget_min_s!r}: use 0 or more")
        for entry in self.redis_sentinels:
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise SettingsError(f"GRADSVC_REDIS_SENTINELS={','.join(self.redis_sentinels)!r}: {entry!r} is not "
                                    "host:port")
        if self.redis_sentinels and not self.redis_sentinel_master:
            raise SettingsError("GRADSVC_REDIS_SENTINEL_MASTER must name the master the sentinels monitor")
        if self.rate_limit_per_minute < 0:
            raise SettingsError(f"GRADSVC_RATE_LIMIT_PER_MINUTE={self.rate_limit_per_minute!r}: use 0 (off) or more")

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
