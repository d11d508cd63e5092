"""A real Prometheus for the metrics tests: a process on loopback scraping a stack's API and worker every
second, and its HTTP query API polled until an answer is what a test waits for. Needs Debian's `prometheus`
package (prometheus and promtool); tests that need it carry `needs_prometheus`."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from gradsvc.runtime.launcher import free_port, wait_port

NEEDS_PROMETHEUS = "needs promtool and prometheus from Debian's `prometheus` package (apt-get install prometheus)"
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                      reason=NEEDS_PROMETHEUS)


def prometheus_config(api_port: int, worker_port: int, api_key: str | None = None) -> str:
    # A keyed deployment shows a scrape the runs of the key it sends (docs/runs.md): the API job sends one.
    auth = f"\n    authorization: {{type: Bearer, credentials: {api_key}}}" if api_key else ""
    return f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: gradsvc-api{auth}
    static_configs: [{{targets: ["127.0.0.1:{api_port}"]}}]
  - job_name: gradsvc-worker
    static_configs: [{{targets: ["127.0.0.1:{worker_port}"]}}]
"""


@contextmanager
def running_prometheus(tmp_path: Path, api_port: int, worker_port: int,
                       api_key: str | None = None) -> Iterator[str]:
    """A Prometheus scraping the API on `api_port` (with `api_key` as its Bearer key, when given) and the worker's
    metrics on `worker_port`, its data and log under `tmp_path`; yields its base URL and stops it on exit."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus_config(api_port, worker_port, api_key))
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_port(port, 30)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def instant(base: str, query: str) -> list[dict]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=5)
    r.raise_for_status()
    return r.json()["data"]["result"]


def poll(base: str, query: str, ok, timeout_s: float = 30) -> list[dict]:
    """Asks `query` every half second until `ok(answer)` or `timeout_s`; returns the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = instant(base, query)
        if ok(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)
