"""The runs' gauges of the API's /metrics (service/api_metrics.py), read from a private Redis at scrape time:
each exported run's last step, at most GRADSVC_RUN_METRICS_RUNS runs of GRADSVC_RUN_METRICS_MODULES modules each,
and no series for a run idle past GRADSVC_RUN_METRICS_IDLE_S or deleted."""

from __future__ import annotations

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gradsvc.broker import keys
from gradsvc.broker.runs import RunStore
from gradsvc.runtime.settings import Settings
from gradsvc.wire import RunCheck, RunStep
from service.api_metrics import EVERY_OWNER, ApiMetrics
from tests.service.test_metrics import _Store


@pytest.fixture()
def runs(redis_server) -> RunStore:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield RunStore(client, "test")
    client.close()


def record(runs: RunStore, name: str, step: int, modules: int = 5, owner: str = "0123456789abcdef") -> None:
    norms = {str(i): float(i + 1) for i in range(modules)}
    runs.record(runs.redis, owner, f"{name}-{step}", RunStep(
        step=step, job_id=f"{name}-{step}", ended_at="", loss=0.5 + step, grad_norm=3.0, module_grad_norms=norms,
        update_ratio={m: 1e-3 for m in norms} if step else None, total_ms=1.0,
        numcheck=RunCheck("exact", step % 2 == 0, 1e-9)), name, numbered=True)


def scrape(runs: RunStore, **settings) -> dict[tuple[str, tuple], float]:
    metrics = ApiMetrics(_Store(), runs, Settings(**settings))
    text = metrics.exposition(EVERY_OWNER).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("gradsvc_run_")}


def test_each_run_exports_its_last_steps_figures_labelled_by_run_owner_and_module(runs):
    record(runs, "exp", 0)
    record(runs, "exp", 1)
    got = scrape(runs)
    run = (("owner", "01234567"), ("run", "exp"))
    assert got[("gradsvc_run_loss", run)] == 1.5 and got[("gradsvc_run_step", run)] == 1
    assert got[("gradsvc_run_gradient_norm", run)] == 3.0 and got[("gradsvc_run_check_passed", run)] == 0
    assert got[("gradsvc_run_module_gradient_norm", (("module", "4"), *run))] == 5.0
    assert got[("gradsvc_run_update_ratio", (("module", "0"), *run))] == 1e-3
    assert not any(name == "gradsvc_run_noise_scale" for name, _ in got)  # no step asked for it


def test_series_are_bounded_by_runs_and_modules_most_recent_runs_first(runs):
    for name in ("a", "b", "c"):
        record(runs, name, 1, modules=6)
    got = scrape(runs, run_metrics_runs=2, run_metrics_modules=3)
    assert {dict(labels)["run"] for _, labels in got} == {"b", "c"}
    assert {dict(labels)["module"] for name, labels in got if name == "gradsvc_run_update_ratio"} == {"0", "1", "2"}
    assert len(got) == 2 * (4 + 2 * 3)  # loss, norm, step, verdict; two series per module
    assert scrape(runs, run_metrics_runs=0) == {}


def test_an_idle_or_deleted_runs_series_are_gone(runs):
    record(runs, "idle", 0)
    record(runs, "gone", 0)
    record(runs, "live", 0)
    runs.redis.zadd(keys.run_exports_key("test"), {"0123456789abcdef idle": 1.0})  # last stepped in 1970
    runs.delete("0123456789abcdef", "gone")
    assert {dict(labels)["run"] for _, labels in scrape(runs, run_metrics_idle_s=900)} == {"live"}


def test_a_run_whose_last_step_ran_no_check_exports_no_check_series(runs):
    record(runs, "exp", 0)
    runs.record(runs.redis, "0123456789abcdef", "exp-1", RunStep(
        step=1, job_id="exp-1", ended_at="", loss=0.5, grad_norm=3.0, module_grad_norms={"0": 1.0}, total_ms=1.0,
        numcheck=RunCheck("off", None, 0.0)), "exp", numbered=True)
    got = scrape(runs)
    assert got[("gradsvc_run_step", (("owner", "01234567"), ("run", "exp")))] == 1
    assert not any(name == "gradsvc_run_check_passed" for name, _ in got)


KEYS = ("metrics-key-alice-0123", "metrics-key-bob-012345")


def served_runs(redis_server, headers: dict | None = None, **settings) -> set[tuple[str, str]]:
    """(run, owner) of the gradsvc_run_step series an API with two keys serves at /metrics to this scrape."""
    from litestar.testing import TestClient

    from service.app import create_app

    app = create_app(Settings(redis_url=redis_server.url, api_keys=KEYS, queue_prefix="test", **settings))
    with TestClient(app) as client:
        r = client.get("/metrics", headers=headers or {})
    assert r.status_code == 200, r.text
    return {(s.labels["run"], s.labels["owner"]) for f in text_string_to_metric_families(r.text)
            for s in f.samples if s.name == "gradsvc_run_step"}


def test_a_keyed_deployment_serves_no_run_series_to_an_unauthenticated_scrape_and_each_key_its_own(runs,
                                                                                                   redis_server):
    """Run names, losses and norms are the key holders' data: with API keys set, a scrape without a key gets
    no gradsvc_run_* series (the rest of /metrics stays open), a scrape with a key its own runs, and every run
    only where the operator opts in (GRADSVC_RUN_METRICS_PUBLIC)."""
    import hashlib

    alice, bob = (hashlib.sha256(k.encode()).hexdigest()[:24] for k in KEYS)
    record(runs, "alice-secret-run", 1, owner=alice)
    record(runs, "bob-run", 1, owner=bob)
    assert served_runs(redis_server) == set()
    assert served_runs(redis_server, {"Authorization": f"Bearer {KEYS[0]}"}) == {("alice-secret-run", alice[:8])}
    assert served_runs(redis_server, {"Authorization": "Bearer not-a-key"}) == set()
    assert served_runs(redis_server, run_metrics_public=True) == {("alice-secret-run", alice[:8]), ("bob-run", bob[:8])}
