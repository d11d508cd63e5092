"""Prometheus metrics of the running stack: the API's /metrics and the worker's own port, after real jobs,
checked by family, label and histogram sample, by promtool, and read back through a real Prometheus."""

from __future__ import annotations

import bisect
import copy
import math
import shutil
import subprocess
import time
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from workers.metrics import PHASE_BUCKETS, PHASES

from tests.support.nets import SEED_A_LAYERS, seed_a_batch
from tests.support.prometheus import NEEDS_PROMETHEUS, instant, needs_prometheus, poll, running_prometheus

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason=NEEDS_PROMETHEUS)


def scrape_text(url: str) -> str:
    r = httpx.get(url, timeout=10)
    r.raise_for_status()
    return r.text


def samples(text: str) -> dict[str, list]:
    """Sample name (with its _bucket/_sum/_count/_total suffix) -> its samples."""
    out: dict[str, list] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append(s)
    return out


def value(found: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def seed_a_body(**options) -> dict:
    x, y = seed_a_batch()
    return {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
            "inputs": x.tolist(), "targets": y.tolist(), "loss": "cross_entropy", "options": options}


def overflowing_body() -> dict:
    """Valid for the API, but its loss overflows to inf in the worker: a job that fails with non_finite."""
    return {"model": {"layers": [{"type": "Linear", "in_features": 6, "out_features": 3}], "dtype": "float64"},
            "inputs": [[1e308] * 6] * 2, "targets": [[0.0] * 3] * 2, "loss": "mse", "options": {"numcheck": "off"}}


def wait_until_idle(http: httpx.Client, timeout_s: float = 60) -> None:
    """Jobs other tests left behind would land in these deltas: wait for the CPU worker's queues to drain."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = samples(http.get("/metrics").text)
        queued = value(found, "gradsvc_queue_depth", queue="gradsvc") + value(
            found, "gradsvc_queue_depth", queue="gradsvc-cpu")
        if queued == 0 and value(found, "gradsvc_workers", state="busy") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the stack's worker did not go idle within {timeout_s} s")


@pytest.fixture(scope="module")
def scraped(stack, http):
    """Scrapes before and after three real jobs (checked, unchecked, failing) so counts compare as deltas."""
    api_url, worker_url = f"{stack.base_url}/metrics", f"http://127.0.0.1:{stack.metrics_port}/metrics"
    wait_until_idle(http)
    before_api, before_worker = samples(http.get("/metrics").text), samples(scrape_text(worker_url))
    checked = http.post("/gradients", json=seed_a_body(numcheck="exact"))
    unchecked = http.post("/gradients", json=seed_a_body(numcheck="off"))
    failed = http.post("/gradients", json=overflowing_body())
    assert (checked.status_code, unchecked.status_code, failed.status_code) == (200, 200, 422), failed.text
    assert failed.json()["error"]["code"] == "non_finite"
    http.get("/jobs/no-such-job")
    api_text = http.get("/metrics").text
    worker_text = scrape_text(worker_url)
    return {"api_url": api_url, "api_text": api_text, "worker_text": worker_text, "api": samples(api_text),
            "worker": samples(worker_text), "before_api": before_api, "before_worker": before_worker,
            "checked": checked.json(), "unchecked": unchecked.json()}


@pytest.fixture(scope="module")
def http(stack):
    with stack.http_client() as client:  # module-scoped: the module-scoped fixtures above scrape with it
        yield client


def delta(scraped, side: str, name: str, **labels: str) -> float:
    return value(scraped[side], name, **labels) - value(scraped[f"before_{side}"], name, **labels)


def assert_histogram_is_consistent(found: dict[str, list], name: str, group: tuple[str, ...]) -> None:
    """Cumulative buckets that never decrease, end in +Inf, and equal _count there, for every label group."""
    buckets = defaultdict(list)
    for s in found[f"{name}_bucket"]:
        buckets[tuple(s.labels[k] for k in group)].append((float(s.labels["le"]), s.value))
    assert buckets, name
    for key, rows in buckets.items():
        rows.sort()
        counts = [c for _, c in rows]
        assert counts == sorted(counts), (name, key)
        assert rows[-1][0] == math.inf
        assert rows[-1][1] == value(found, f"{name}_count", **dict(zip(group, key))), (name, key)


# --- the API ----------------------------------------------------------------------------------------

def test_api_counts_requests_by_route_template_method_and_status(scraped):
    assert delta(scraped, "api", "gradsvc_http_requests_total", method="POST", route="/gradients", status="200") == 2
    assert delta(scraped, "api", "gradsvc_http_requests_total", method="POST", route="/gradients", status="422") == 1
    # The template, never the job id: label values stay bounded.
    assert delta(scraped, "api", "gradsvc_http_requests_total", method="GET", route="/jobs/{job_id}",
                 status="404") == 1
    routes = {s.labels["route"] for s in scraped["api"]["gradsvc_http_requests_total"]}
    assert not any("no-such-job" in r for r in routes)
    assert delta(scraped, "api", "gradsvc_jobs_submitted_total") == 3


def test_api_latency_histogram_has_cumulative_buckets_by_method_and_route(scraped):
    found = scraped["api"]
    assert_histogram_is_consistent(found, "gradsvc_http_request_duration_seconds", ("method", "route"))
    assert delta(scraped, "api", "gradsvc_http_request_duration_seconds_count", method="POST",
                 route="/gradients") == 3
    les = {float(s.labels["le"]) for s in found["gradsvc_http_request_duration_seconds_bucket"]}
    assert min(les) < 0.001 and 60 <= max(les - {math.inf})  # sub-ms answers to long synchronous waits


def test_api_reads_queue_depth_per_queue_and_workers_by_state_from_redis(scraped):
    found = scraped["api"]
    assert {s.labels["queue"] for s in found["gradsvc_queue_depth"]} == {"gradsvc", "gradsvc-cpu", "gradsvc-cuda",
                                                                         "gradsvc-own"}
    assert all(s.value >= 0 and s.value == int(s.value) for s in found["gradsvc_queue_depth"])
    states = {s.labels["state"]: s.value for s in found["gradsvc_workers"]}
    assert set(states) == {"idle", "busy", "suspended"}
    assert states["idle"] + states["busy"] >= 1  # the stack's worker, registered in Redis


@needs_promtool
@pytest.mark.parametrize("side", ["api_text", "worker_text"])
def test_promtool_check_metrics_accepts_the_exposition(scraped, side):
    run = subprocess.run(["promtool", "check", "metrics"], input=scraped[side], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr


# --- the worker -------------------------------------------------------------------------------------

def test_worker_observes_every_phase_by_device_and_skips_phases_that_did_not_run(scraped):
    name = "gradsvc_job_phase_duration_seconds_count"
    for phase in ("queue_wait", "forward", "backward", "total"):
        assert delta(scraped, "worker", name, phase=phase, device="cpu") == 2, phase
    assert delta(scraped, "worker", name, phase="numcheck", device="cpu") == 1  # numcheck off is not a 0 s check
    assert delta(scraped, "worker", name, phase="memory", device="cpu") == 2
    assert {s.labels["phase"] for s in scraped["worker"][name]} == set(PHASES)
    assert_histogram_is_consistent(scraped["worker"], "gradsvc_job_phase_duration_seconds", ("phase", "device"))
    les = sorted({float(s.labels["le"]) for s in scraped["worker"]["gradsvc_job_phase_duration_seconds_bucket"]})
    assert les[0] <= 0.0001 and les[-2] >= 300  # sub-millisecond to minutes


def test_worker_phase_sums_match_the_timings_the_results_report(scraped):
    timings = [scraped["checked"]["timings"], scraped["unchecked"]["timings"]]
    for phase in ("forward", "backward", "total"):
        got = delta(scraped, "worker", "gradsvc_job_phase_duration_seconds_sum", phase=phase, device="cpu")
        assert got == pytest.approx(sum(t[f"{phase}_ms"] for t in timings) / 1e3, rel=1e-9), phase
    got = delta(scraped, "worker", "gradsvc_job_phase_duration_seconds_sum", phase="numcheck", device="cpu")
    assert got == pytest.approx(timings[0]["numcheck_ms"] / 1e3, rel=1e-9)


def test_worker_counts_outcomes_by_status_device_and_error_code(scraped):
    name = "gradsvc_jobs_completed_total"
    assert delta(scraped, "worker", name, status="finished", device="cpu", code="") == 2
    assert delta(scraped, "worker", name, status="failed", device="cpu", code="non_finite") == 1


def test_worker_exports_activation_bytes_and_numcheck_error_per_job(scraped):
    saved = delta(scraped, "worker", "gradsvc_activation_saved_bytes_sum")
    assert saved == sum(scraped[k]["memory"]["saved_bytes_total"] for k in ("checked", "unchecked"))
    assert delta(scraped, "worker", "gradsvc_activation_saved_bytes_count") == 2
    assert delta(scraped, "worker", "gradsvc_numcheck_max_rel_error_count") == 1
    err = delta(scraped, "worker", "gradsvc_numcheck_max_rel_error_sum")
    assert err == pytest.approx(scraped["checked"]["numcheck"]["max_rel_error"], rel=1e-9)
    assert_histogram_is_consistent(scraped["worker"], "gradsvc_numcheck_max_rel_error", ())
    assert value(scraped["worker"], "gradsvc_worker_busy") == 0


# --- a real Prometheus --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prometheus(stack, http, tmp_path_factory):
    """A Prometheus on loopback scraping the stack every second; a job has run before its first scrape, so the
    phase histogram's series already exist and the first test's own job shows as their only increase."""
    tmp_path = tmp_path_factory.mktemp("prometheus")
    wait_until_idle(http)
    assert http.post("/gradients", json=seed_a_body(numcheck="off")).status_code == 200
    with running_prometheus(tmp_path, stack.api_port, stack.metrics_port) as base:
        yield base


@needs_prometheus
def test_prometheus_scrapes_the_stack_and_answers_a_phase_duration_quantile(prometheus, http):
    up = poll(prometheus, "up", lambda r: len(r) == 2 and all(x["value"][1] == "1" for x in r))
    assert sorted((x["metric"]["job"], x["value"][1]) for x in up) == [("gradsvc-api", "1"), ("gradsvc-worker", "1")]
    # The job runs after the first scrape, so the rate window holds exactly its one observation.
    r = http.post("/gradients", json=seed_a_body(numcheck="exact"))
    assert r.status_code == 200, r.text
    total_s = r.json()["timings"]["total_ms"] / 1e3
    query = ('histogram_quantile(0.5, sum by (le, device) '
             '(rate(gradsvc_job_phase_duration_seconds_bucket{phase="total"}[1m])))')
    got = poll(prometheus, query, lambda r: bool(r) and r[0]["value"][1] not in ("NaN", "0"))
    assert got and got[0]["metric"] == {"device": "cpu"}, got
    quantile = float(got[0]["value"][1])
    # histogram_quantile interpolates inside the bucket that holds the job's total time.
    i = bisect.bisect_left(PHASE_BUCKETS, total_s)
    low, high = (PHASE_BUCKETS[i - 1] if i else 0.0), PHASE_BUCKETS[i]
    assert low <= quantile <= high, (quantile, total_s)
    depth = instant(prometheus, "gradsvc_queue_depth")
    assert {x["metric"]["queue"] for x in depth} == {"gradsvc", "gradsvc-cpu", "gradsvc-cuda", "gradsvc-own"}


@needs_prometheus
def test_prometheus_evaluates_every_dashboard_query_and_the_phase_panels_show_data(prometheus, http):
    from .test_dashboards import dashboard_exprs

    poll(prometheus, "up", lambda r: len(r) == 2 and all(x["value"][1] == "1" for x in r))
    assert http.post("/gradients", json=seed_a_body(numcheck="exact")).status_code == 200
    phase_p50 = next(e for _, title, e in dashboard_exprs() if title == "Job phase p50 by device")
    got = poll(prometheus, phase_p50, lambda r: {x["metric"].get("phase") for x in r} >= set(PHASES))
    assert {x["metric"]["phase"] for x in got} >= set(PHASES), got
    for dashboard, title, expr in dashboard_exprs():
        r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5)
        assert r.status_code == 200 and r.json()["status"] == "success", (dashboard, title, r.text)


def _disconnect_mid_body(stack, body: bytes) -> None:
    """A client that announces the whole body, sends a tenth of it and closes the connection."""
    import socket

    with socket.create_connection(("127.0.0.1", stack.api_port), timeout=10) as sock:
        sock.sendall(b"POST /gradients HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + b"".join(f"{k}: {v}\r\n".encode() for k, v in stack.auth_headers().items())
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 10])
        time.sleep(0.3)


def _disconnect_mid_wait(stack, body: bytes) -> None:
    """A client that sends a whole request, waiting for its job (?wait=60), and closes before the answer."""
    import socket

    with socket.create_connection(("127.0.0.1", stack.api_port), timeout=10) as sock:
        sock.sendall(b"POST /gradients?wait=60 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + b"".join(f"{k}: {v}\r\n".encode() for k, v in stack.auth_headers().items())
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.3)


def test_client_disconnects_are_counted_as_499_not_500(stack, http):
    import json

    wait_until_idle(http)
    before = samples(http.get("/metrics").text)
    # A job that keeps the one worker busy for a while (~4 s: 121,200 evaluations), so the second request waits
    # behind it past its client's leaving (one of ~1.3 s ran its 38,380 before the client left, on a fast day).
    slow = {"model": {"layers": [{"type": "Linear", "in_features": 100, "out_features": 600}], "dtype": "float64"},
            "inputs": [[0.1] * 100] * 4, "targets": [[0.0] * 600] * 4, "loss": "mse", "options": {"numcheck": "exact"}}
    busy = http.post("/gradients?wait=0", json=slow)
    assert busy.status_code == 202, busy.text
    body = json.dumps(seed_a_body(numcheck="off")).encode()
    _disconnect_mid_body(stack, body)
    _disconnect_mid_wait(stack, body)
    counted = lambda status: value(samples(http.get("/metrics").text), "gradsvc_http_requests_total",  # noqa: E731
                                   method="POST", route="/gradients", status=status) - value(
        before, "gradsvc_http_requests_total", method="POST", route="/gradients", status=status)
    deadline = time.monotonic() + 60  # the waiting request is counted once its handler ends (the job ran)
    while counted("499") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counted("499") == 2 and counted("500") == 0, (counted("499"), counted("500"))
    wait_until_idle(http)
