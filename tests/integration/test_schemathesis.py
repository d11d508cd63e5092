"""Property-based tests from GET /schema (OpenAPI 3.1) with schemathesis 4.x and every check: a bounded
number of examples per operation, no 5xx other than 503, every response valid against the schema, what the
schema forbids refused and what it allows not refused with a 400 (the repository's schemathesis.toml says why
a 422 is an expected answer to schema-valid data). A dedicated stack keeps `wait` short
(GRADSVC_MAX_WAIT_S=2), so generated wait values cannot hold a request for long."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.config import SchemathesisConfig

from tests.support.stack import start_stack
from tests.support.suite import TEST_ALL

ROOT = Path(__file__).resolve().parents[2]

# Examples per operation: 30 in `make test-all` (GRADSVC_TEST_ALL=1), 15 in `make test` (suite time).
MAX_EXAMPLES = 30 if TEST_ALL else 15
# `st run`'s fuzzing and stateful phases: 30 examples in `make test-all`, 5 in `make test`, where every operation's
# generated inputs and every check on their answers are test_no_input_gets_a_5xx_other_than_503_or_breaks_the_schema's
# 15 an operation; its coverage phase (each schema boundary once) does not depend on the number.
ST_RUN_EXAMPLES = 30 if TEST_ALL else 5
OPERATIONS = ["POST /gradients", "POST /estimate", "GET /jobs/{job_id}", "POST /jobs/{job_id}/cancel", "GET /layers",
              "PUT /tensors/{ref}", "POST /tensors/missing", "GET /runs", "GET /runs/{name}", "DELETE /runs/{name}",
              "POST /sessions", "GET /sessions/{session_id}", "DELETE /sessions/{session_id}",
              "POST /sessions/{session_id}/step", "POST /sessions/{session_id}/forward_backward",
              "POST /sessions/{session_id}/forward", "POST /sessions/{session_id}/optim_step", "GET /sessions/{session_id}/weights",
              "GET /healthz", "GET /readyz", "GET /metrics"]


@pytest.fixture(scope="module")
def schema_stack():
    s = start_stack(workers=1, GRADSVC_MAX_WAIT_S="2", GRADSVC_DEFAULT_WAIT_S="1", GRADSVC_JOB_TIMEOUT_S="20",
                    GRADSVC_MAX_PARAMETERS="200000", GRADSVC_MAX_ELEMENTS="200000")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(schema_stack):
    return schemathesis.openapi.from_url(f"{schema_stack.base_url}/schema",
                                         config=SchemathesisConfig.from_path(ROOT / "schemathesis.toml"))


@pytest.mark.slow
def test_st_run_with_every_check_reports_no_failure(schema_stack):
    """The command a user runs: `st run <url>/schema --checks all`, from the repository root, every check on
    (the cancel is POST /jobs/{id}/cancel: no DELETE leaves a job readable for use_after_free to flag). 60 s here:
    in `make test-all`; `make test` covers every operation with every check below (each operation's generated
    requests and each answer's validation), without the CLI's stateful phase."""
    st = Path(sys.executable).with_name("st")
    out = subprocess.run([str(st), "run", f"{schema_stack.base_url}/schema", "--checks", "all",
                          "--max-examples", str(ST_RUN_EXAMPLES), "--seed", "1", "--no-color"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "passed" in out.stdout and "failed" not in out.stdout.split("SUMMARY")[-1]


def test_the_schema_lists_every_route(api_schema):
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS)


@pytest.mark.parametrize("label", OPERATIONS)
def test_no_input_gets_a_5xx_other_than_503_or_breaks_the_schema(api_schema, schema_stack, label):
    operation = api_schema.find_operation_by_label(label)
    calls = []

    @given(case=operation.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    def check(case):
        response = case.call(base_url=schema_stack.base_url, timeout=30)
        calls.append(response.status_code)
        assert response.status_code < 500 or response.status_code == 503, \
            (case.method, case.path, case.body, response.status_code, response.text[:500])
        case.validate_response(response)  # every check, configured by schemathesis.toml

    check()
    print(f"{label}: {len(calls)} calls, statuses {sorted(set(calls))}")
    for proc in schema_stack.workers:
        assert proc.poll() is None, f"a worker exited; logs in {schema_stack.logdir}"


def _valid_bodies() -> list[dict]:
    base = {"model": {"layers": [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Tanh"},
                                 {"type": "Linear", "in_features": 8, "out_features": 3}], "dtype": "float64",
                      "seed": 0},
            "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
            "loss": "cross_entropy"}
    options = [{}, {"numcheck": "exact"}, {"numcheck": "directional", "encoding": "b64"},
               {"per_sample": "norms", "input_grad": True}, {"hvp": {"vector": "random", "seed": 1}, "graph": True},
               {"micro_batch": 1, "memory": False, "per_sample": "full"}]
    return [{**base, "options": o} for o in options]


@pytest.mark.parametrize("wait", [2, 0])
def test_real_results_jobs_and_estimates_match_the_schema(api_schema, schema_stack, wait):
    gradients = api_schema.find_operation_by_label("POST /gradients")
    estimate = api_schema.find_operation_by_label("POST /estimate")
    get_job = api_schema.find_operation_by_label("GET /jobs/{job_id}")
    cancel = api_schema.find_operation_by_label("POST /jobs/{job_id}/cancel")
    for body in _valid_bodies():
        case = gradients.Case(body=body, query={"wait": wait}, media_type="application/json")
        response = case.call(base_url=schema_stack.base_url, timeout=30)
        assert response.status_code in (200, 202), response.text[:500]
        case.validate_response(response)
        job_id = response.json()["job_id"]
        for op in (get_job, cancel, get_job):
            job_case = op.Case(path_parameters={"job_id": job_id})
            r = job_case.call(base_url=schema_stack.base_url, timeout=30)
            assert r.status_code == 200, r.text[:500]
            job_case.validate_response(r)
        est = estimate.Case(body=body, media_type="application/json")
        r = est.call(base_url=schema_stack.base_url, timeout=30)
        assert r.status_code == 200, r.text[:500]
        est.validate_response(r)


def test_a_real_sessions_answers_match_the_schema(api_schema, schema_stack):
    """A session created, stepped (the weights and gradients returned), accumulated, read and deleted: each answer
    valid against its operation's schema."""
    label = api_schema.find_operation_by_label
    body = {"model": _valid_bodies()[0]["model"], "optimizer": {"type": "adamw", "lr": 0.01},
            "options": {"clip": {"max_norm": 1.0}}, "run": "schema-session"}
    created = label("POST /sessions").Case(body=body, query={"wait": 2}, media_type="application/json")
    r = created.call(base_url=schema_stack.base_url, timeout=30)
    assert r.status_code == 201, r.text[:500]
    created.validate_response(r)
    sid = {"session_id": r.json()["session_id"]}
    batch = {k: _valid_bodies()[0][k] for k in ("inputs", "targets", "loss")}
    calls = [("POST /sessions/{session_id}/step", {**batch, "return": ["gradients", "weights"],
                                                   "options": {"diagnostics": ["norms"]}}),
             ("POST /sessions/{session_id}/forward_backward", batch),
             ("POST /sessions/{session_id}/forward", {**batch, "return": ["outputs"]}),
             ("POST /sessions/{session_id}/optim_step", {"lr": 0.001}),
             ("GET /sessions/{session_id}/weights", None), ("GET /sessions/{session_id}", None),
             ("DELETE /sessions/{session_id}", None)]
    for name, payload in calls:
        kwargs = {"body": payload, "media_type": "application/json"} if payload is not None else {}
        case = label(name).Case(path_parameters=sid, **kwargs)
        r = case.call(base_url=schema_stack.base_url, timeout=30)
        assert r.status_code == 200, (name, r.text[:500])
        case.validate_response(r)
    assert label("GET /sessions/{session_id}").Case(path_parameters=sid).call(
        base_url=schema_stack.base_url, timeout=30).status_code == 404
