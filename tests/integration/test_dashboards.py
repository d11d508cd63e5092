"""The Grafana dashboards and deploy/ files against the running stack: every PromQL expression parses
(promtool) and names only metrics the API and worker really export; the compose, Prometheus and Grafana
files point at each other; the image's healthcheck answers for both roles."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gradsvc.runtime.launcher import free_port

from tests.support.stack import ROOT
from .test_metrics import NEEDS_PROMETHEUS, samples, seed_a_body

DEPLOY = ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
# Grafana's built-in interval variables, given the value they take for a one-hour view, and the dashboards' own
# (the runs dashboard's $run: a run name).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$run": "exp-1"}
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring",
                   "group_left", "group_right"}


def panels(node):
    """Every panel, including those nested in rows."""
    for panel in node.get("panels", []):
        yield panel
        yield from panels(panel)


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL with Grafana's variables substituted) for every query."""
    out = []
    for path in DASHBOARDS:
        for panel in panels(json.loads(path.read_text())):
            for target in panel.get("targets", []):
                expr = target["expr"]
                for var, val in GRAFANA_VARIABLES.items():
                    expr = expr.replace(var, val)
                out.append((path.name, panel["title"], expr))
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers left once strings, label matchers, ranges and
    grouping clauses are removed, that are neither functions nor keywords."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        if m.group() not in PROMQL_KEYWORDS and not e[m.end():].lstrip().startswith("("):
            names.add(m.group())
    return names


@pytest.fixture(scope="module")
def exported(stack) -> set[str]:
    """Every sample name (with _bucket/_sum/_count/_total) the API and the worker export after a real job, a step
    of a training run, a training session's step; and the families declared without a sample yet (a run's noise scale, when no step asked
    for it)."""
    with stack.http_client() as http:
        r = http.post("/gradients", json={**seed_a_body(numcheck="exact"), "run": {"name": "exp-1"}})
        assert r.status_code == 200, r.text
        created = http.post("/sessions", json={"model": seed_a_body()["model"], "optimizer": {"type": "sgd"}})
        assert created.status_code == 201, created.text
        body = seed_a_body()
        step = http.post(f"/sessions/{created.json()['session_id']}/step",
                         json={k: body[k] for k in ("inputs", "targets", "loss")})
        assert step.status_code == 200, step.text
        api = http.get("/metrics").text
    worker = httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).text
    declared = {f.name for text in (api, worker) for f in text_string_to_metric_families(text) if f.type == "gauge"}
    return set(samples(api)) | set(samples(worker)) | declared


def test_dashboards_exist_and_every_panel_has_a_query():
    assert {p.name for p in DASHBOARDS} == {"gradsvc-api.json", "gradsvc-jobs.json", "gradsvc-runs.json"}
    for path in DASHBOARDS:
        for panel in panels(json.loads(path.read_text())):
            if panel["type"] != "row":
                assert panel.get("targets"), f"{path.name}: panel {panel['title']!r} has no query"


def test_metric_names_reads_selectors_not_functions_labels_or_keywords():
    expr = ('histogram_quantile(0.5, sum by (le, device) (rate(a_bucket{phase="total", le="1e-06"}[1m]))) '
            '/ on (device) group_left b_count offset 5m and c')
    assert metric_names(expr) == {"a_bucket", "b_count", "c"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason=NEEDS_PROMETHEUS)
def test_promtool_parses_every_dashboard_query(tmp_path: Path):
    exprs = dashboard_exprs()
    assert all("$" not in expr for _, _, expr in exprs), "a Grafana variable is left unsubstituted"
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, _, expr) in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    run = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in run.stdout


def test_every_metric_a_dashboard_queries_is_exported(exported):
    for dashboard, title, expr in dashboard_exprs():
        names = metric_names(expr)
        assert names, f"{dashboard}: {title!r} selects no metric: {expr}"
        missing = names - exported
        assert not missing, f"{dashboard}: {title!r} queries {sorted(missing)}, which nothing exports"


def test_dashboards_cover_every_exported_gradsvc_family(exported):
    queried = set().union(*(metric_names(expr) for _, _, expr in dashboard_exprs()))
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported
                if n.startswith("gradsvc_") and not n.endswith("_created")}
    shown = {f for f in families if any(q == f or q.startswith(f + "_") for q in queried)}
    assert families - shown == set()


# --- deploy/: the files point at each other ----------------------------------------------------------

def test_every_panel_uses_the_provisioned_datasource():
    provisioned = re.search(r"^\s*uid:\s*(\S+)", (DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
                            .read_text(), re.M).group(1)
    for path in DASHBOARDS:
        for panel in panels(json.loads(path.read_text())):
            for item in [panel, *panel.get("targets", [])]:
                if "datasource" in item:
                    assert item["datasource"]["uid"] == provisioned, (path.name, panel["title"])


def test_compose_runs_both_worker_kinds_scraped_by_prometheus_with_grafana_provisioned():
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    assert {"redis", "api", "worker-gpu", "worker-cpu", "prometheus", "grafana"} <= set(compose)
    gpu = compose["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    workers = {name for name, s in compose.items() if s.get("command") == ["worker"]}
    assert workers == {"worker-gpu", "worker-cpu"}
    for name in workers | {"api"}:
        assert compose[name]["environment"]["GRADSVC_HOST"] == "0.0.0.0", name
    scrape = {job["job_name"]: job for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]}
    assert scrape["gradsvc-api"]["dns_sd_configs"][0]["names"] == ["api"]
    assert set(scrape["gradsvc-worker"]["dns_sd_configs"][0]["names"]) == workers
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["grafana"]["volumes"] if v.startswith("./"))
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/gradsvc.yml").read_text())["providers"][0]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in compose["prometheus"]["volumes"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason=NEEDS_PROMETHEUS)
def test_promtool_accepts_the_compose_prometheus_config():
    run = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_dockerfile_pins_the_makefiles_torch_and_copies_only_what_dockerignore_admits():
    dockerfile = (ROOT / "Dockerfile").read_text()
    pin = re.search(r"^TORCH_PIN \?= torch==(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"ARG TORCH_VERSION={pin}" in dockerfile
    admitted = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.startswith("!")}
    for source in re.findall(r"^COPY (\S+) ", dockerfile, re.M):
        assert source.rstrip("/") in admitted, source
        assert (ROOT / source).exists(), source
    assert re.search(r"^USER (?!root)\S+", dockerfile, re.M)
    assert re.search(r"^HEALTHCHECK ", dockerfile, re.M)


def test_healthcheck_passes_for_the_api_or_the_worker_and_fails_when_neither_answers(stack):
    def healthcheck(api_port: int, worker_port: int) -> int:
        env = {**os.environ, "GRADSVC_PORT": str(api_port), "GRADSVC_WORKER_METRICS_PORT": str(worker_port)}
        return subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py")], env=env, capture_output=True,
                              timeout=30).returncode

    nobody = free_port()
    assert healthcheck(stack.api_port, nobody) == 0
    assert healthcheck(nobody, stack.metrics_port) == 0
    assert healthcheck(nobody, nobody) == 1
