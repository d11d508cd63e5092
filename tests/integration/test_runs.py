"""Training runs through the SDK, the API, Redis and a real worker: a loop trains an MLP and a small transformer
with a local optimizer through client.run, and every recorded step matches what the loop saw: its loss, the
norms of the gradients the call returned, the update ratios of the optimizer's steps; the CSV says the same;
another API key sees none of it."""

from __future__ import annotations

import csv
import io
import json
import math

import httpx
import msgspec
import pytest
import torch
from msgspec.structs import fields as msgspec_fields
from torch import nn

from gradclient import Client
from gradclient.errors import BadOptionError, NotFoundError
from gradsvc import wire
from tests.support.models import SmallTransformer
from tests.support.prometheus import needs_prometheus, poll, running_prometheus
from tests.support.stack import ROOT, module_stack

from .test_dashboards import panels

pytestmark = pytest.mark.timeout(600)
KEYS = ("run-key-alice", "run-key-bob")
runs_stack = module_stack(workers=1, GRADSVC_API_KEYS=",".join(KEYS))


def module_of(name: str) -> str:
    parent = name.rpartition(".")[0]
    return parent or name


def norms(tensors: dict[str, torch.Tensor]) -> tuple[float, dict[str, float]]:
    squares: dict[str, float] = {}
    for name, t in tensors.items():
        squares[module_of(name)] = squares.get(module_of(name), 0.0) + float(t.double().pow(2).sum())
    return math.sqrt(sum(squares.values())), {m: math.sqrt(s) for m, s in squares.items()}


def ratios(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    moved = norms({n: after[n] - before[n] for n in before})[1]
    size = norms(before)[1]
    return {m: moved[m] / size[m] for m in moved}


def train(client: Client, name: str, model: nn.Module, batches, steps: int, **options) -> list[dict]:
    """A local training loop whose gradients come from the service: what each step saw, to compare."""
    run = client.run(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    seen = []
    for step in range(steps):
        x, y = batches(step)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        result = run.gradients(model, x, y, loss="cross_entropy", **options)
        grads = {n: torch.as_tensor(g) for n, g in result.gradients.items() if g is not None}
        for n, p in model.named_parameters():
            p.grad = grads[n].to(p.dtype)
        opt.step()
        seen.append({"loss": result.loss, "job_id": result.job_id, "grads": grads, "weights": weights})
    return seen


def assert_recorded(steps, seen: list[dict]) -> None:
    assert [s.step for s in steps] == list(range(len(seen)))
    for t, (rec, want) in enumerate(zip(steps, seen)):
        assert rec.job_id == want["job_id"]
        assert rec.loss == want["loss"]
        grad_norm, module_norms = norms(want["grads"])
        assert rec.grad_norm == pytest.approx(grad_norm, rel=1e-6)
        assert rec.module_grad_norms.keys() == module_norms.keys()
        for m, v in module_norms.items():
            assert rec.module_grad_norms[m] == pytest.approx(v, rel=1e-6), m
        if t == 0:
            assert rec.update_ratio is None
            continue
        expected = ratios(seen[t - 1]["weights"], want["weights"])
        assert rec.update_ratio.keys() == expected.keys()
        for m, v in expected.items():
            assert v > 0 and rec.update_ratio[m] == pytest.approx(v, rel=1e-6), m


def mlp_batches(step: int):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def transformer_batches(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 20, (4, 6), generator=gen), torch.randint(0, 3, (4,), generator=gen)


@pytest.fixture()
def alice(runs_stack):
    with Client(runs_stack.base_url, api_key=KEYS[0], timeout=300) as c:
        yield c


@pytest.fixture()
def bob_http(runs_stack):
    with httpx.Client(base_url=runs_stack.base_url, headers={"Authorization": f"Bearer {KEYS[1]}"},
                      timeout=60) as c:
        yield c


def test_mlp_run_records_each_steps_loss_norms_and_update_ratios(alice):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    seen = train(alice, "mlp <b>&", model, mlp_batches, steps=4)
    steps = alice.run("mlp <b>&").steps()
    assert_recorded(steps, seen)
    assert all(s.numcheck is not None and s.numcheck.passed for s in steps)
    assert set(steps[0].module_grad_norms) == {"0", "2"}
    listed = {r.name: r for r in alice.runs()}
    assert listed["mlp <b>&"].steps == 4 and listed["mlp <b>&"].last_step == 3


def test_small_transformer_run_records_each_step_as_the_loop_saw_it(alice):
    torch.manual_seed(0)
    model = SmallTransformer(dim=16, layers=1, vocab=20, classes=3)
    seen = train(alice, "transformer", model, transformer_batches, steps=3, numcheck="directional")
    steps = alice.run("transformer").steps()
    assert_recorded(steps, seen)
    assert "pos" in steps[0].module_grad_norms  # a parameter of the root module is a module of its own
    assert "encoder.layers.0.self_attn" in steps[0].module_grad_norms


def test_run_csv_has_a_row_per_step_with_modules_as_columns(alice):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    train(alice, "csv-run", model, mlp_batches, steps=3, numcheck="off")
    run = alice.run("csv-run")
    steps = run.steps()
    rows = list(csv.DictReader(io.StringIO(run.csv())))
    assert len(rows) == 3
    for row, s in zip(rows, steps):
        assert int(row["step"]) == s.step and row["job_id"] == s.job_id
        assert float(row["loss"]) == s.loss and float(row["grad_norm"]) == s.grad_norm
        for m in ("0", "2"):
            assert float(row[f"grad_norm[{m}]"]) == s.module_grad_norms[m]
            assert row[f"update_ratio[{m}]"] == ("" if s.update_ratio is None else repr(s.update_ratio[m]))
        assert row["numcheck_mode"] == "off" and row["numcheck_passed"] == "" and s.numcheck.passed is None


def test_another_key_sees_no_run_and_cannot_delete_it_with_404(alice, bob_http):
    model = nn.Sequential(nn.Linear(6, 3))
    train(alice, "private", model, mlp_batches, steps=1, numcheck="off")
    assert bob_http.get("/runs").json() == []
    for method in ("GET", "DELETE"):
        r = bob_http.request(method, "/runs/private")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    assert bob_http.get("/runs/private", params={"format": "csv"}).status_code == 404
    assert len(alice.run("private").steps()) == 1


def test_delete_removes_the_run_and_a_later_read_is_404(alice):
    train(alice, "to-delete", nn.Sequential(nn.Linear(6, 3)), mlp_batches, steps=1, numcheck="off")
    alice.run("to-delete").delete()
    with pytest.raises(NotFoundError):
        alice.run("to-delete").steps()
    assert "to-delete" not in {r.name for r in alice.runs()}


def test_service_numbers_steps_sent_without_a_number(runs_stack, bob_http):
    body = {"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}]},
            "inputs": [[1.0, 2.0]], "targets": [1], "options": {"numcheck": "off"}, "run": {"name": "auto"}}
    for _ in range(3):
        answer = bob_http.post("/gradients", json=body)
        assert answer.status_code == 200 and answer.json()["numcheck"]["passed"] is None  # the check did not run
    steps = bob_http.get("/runs/auto").json()["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert [s["numcheck"] for s in steps] == [{"mode": "off", "passed": None, "max_rel_error": 0.0}] * 3


def test_rejects_a_run_with_shards_with_422(alice):
    with pytest.raises(BadOptionError, match="shards"):
        alice.run("sharded").gradients(nn.Sequential(nn.Linear(6, 3)), *mlp_batches(0), shards=2)


def test_options_on_a_run_lists_its_methods(bob_http):
    r = bob_http.options("/runs/anything")
    assert r.status_code == 204 and r.headers["allow"] == "DELETE, GET, OPTIONS"


@pytest.mark.parametrize("run", [{"name": ""}, {"name": "a/b"}, {"name": "tab\there"}, {"name": "x" * 129},
                                 {"name": "x", "step": -1}, {"name": "x", "step": 10**12 + 1}])
def test_rejects_a_bad_run_name_or_step_with_400(bob_http, run):
    body = {"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}]},
            "inputs": [[1.0, 2.0]], "targets": [1], "run": run}
    r = bob_http.post("/gradients", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_body", r.text


@pytest.fixture()
def prometheus(runs_stack, tmp_path):
    """A Prometheus on loopback scraping the stack's API (which exports the runs) every second with alice's key:
    a keyed deployment shows a scrape the runs of the key it sends."""
    with running_prometheus(tmp_path, runs_stack.api_port, runs_stack.metrics_port, api_key=KEYS[0]) as base:
        yield base


@needs_prometheus
def test_every_panel_of_the_runs_dashboard_shows_the_run_in_a_real_prometheus(alice, prometheus):
    # The noise scale comes with options.diagnostics; where this service has none, its panel is the one left out.
    diagnostics = "diagnostics" in {f.name for f in msgspec_fields(wire.Options)}
    options = {"diagnostics": ["noise_scale"]} if diagnostics else {}
    torch.manual_seed(0)
    train(alice, "dash <run>", nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), mlp_batches, steps=3,
          **options)
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/gradsvc-runs.json").read_text())
    assert dashboard["title"] == "gradsvc training runs"
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["run"]
    variable = dashboard["templating"]["list"][0]["query"]["query"]
    runs = poll(prometheus, "gradsvc_run_step", lambda r: any(x["metric"]["run"] == "dash <run>" for x in r))
    assert "dash <run>" in {x["metric"]["run"] for x in runs}, variable
    for panel in panels(dashboard):
        if panel["type"] == "row" or (not diagnostics and "noise_scale" in panel["targets"][0]["expr"]):
            continue
        expr = panel["targets"][0]["expr"].replace("$run", "dash <run>")
        got = poll(prometheus, expr, bool)
        assert got, f"{panel['title']!r}: {expr} returned no data"
        if "module" in expr:
            assert {x["metric"]["module"] for x in got} == {"0", "2"}, panel["title"]
    step = poll(prometheus, 'gradsvc_run_step{run="dash <run>"}', lambda r: r and r[0]["value"][1] == "2")
    assert step[0]["value"][1] == "2"


@pytest.mark.slow  # 90 s (a stack of its own, a killed worker's lease); tests/gradsvc/broker/test_runs.py covers
# a replayed write recording once, this the whole path
def test_a_step_whose_worker_is_killed_records_nothing_and_its_resend_is_recorded_once():
    import signal

    from tests.support.stack import start_stack, wait_status

    s = start_stack(workers=1)
    try:
        with s.http_client(timeout=90) as http:
            small = {"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}]},
                     "inputs": [[1.0, 2.0]], "targets": [1], "options": {"numcheck": "off"}}
            assert http.post("/gradients", json={**small, "run": {"name": "killed", "step": 0}}).status_code == 200
            layers = [{"type": "Linear", "in_features": 256, "out_features": 256}, {"type": "Tanh"}] * 4
            slow = {"model": {"layers": layers, "dtype": "float64"}, "inputs": [[0.1] * 256] * 16,
                    "targets": [[0.0] * 256] * 16, "loss": "mse", "options": {"numcheck": "exact"},
                    "run": {"name": "killed", "step": 1}}
            lost = http.post("/gradients?wait=0", json=slow).json()["job_id"]
            assert wait_status(http, lost, ("started",))["status"] == "started"
            s.workers[0].send_signal(signal.SIGKILL)
            s.workers[0].wait()
            assert wait_status(http, lost)["error"]["code"] == "worker_lost"
            s.start_worker()
            s.wait_ready(1)
            resent = http.post("/gradients", json={**small, "run": {"name": "killed", "step": 1}})
            assert resent.status_code == 200, resent.text
            steps = http.get("/runs/killed").json()["steps"]
            assert [(x["step"], x["job_id"]) for x in steps] == [(0, steps[0]["job_id"]), (1, resent.json()["job_id"])]
            assert lost not in {x["job_id"] for x in steps}
    finally:
        s.stop()


def test_a_run_survives_an_api_restart(runs_stack, alice):
    train(alice, "durable", nn.Sequential(nn.Linear(6, 3)), mlp_batches, steps=2, numcheck="off")
    before = alice.run("durable").steps()
    runs_stack.api.terminate()
    runs_stack.api.wait(timeout=30)
    runs_stack.start_api()
    runs_stack.wait_ready(1)
    assert alice.run("durable").steps() == before


def test_a_step_records_the_noise_scale_and_clip_its_call_returned(alice):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    result = alice.run("diagnosed").gradients(model, *mlp_batches(0), numcheck="off", diagnostics=["noise_scale"],
                                              clip={"max_norm": 0.1})
    step = alice.run("diagnosed").steps()[0]
    assert step.noise_scale is not None and step.noise_scale == result.diagnostics.noise_scale.b_simple
    assert step.clip == msgspec.to_builtins(result.clip) and step.clip["scale"] < 1
    unclipped = {n: torch.as_tensor(g) / step.clip["scale"] for n, g in result.gradients.items()}
    grad_norm, module_norms = norms(unclipped)  # the norms before the clip, as a run records them
    assert step.grad_norm == pytest.approx(grad_norm, rel=1e-5) == pytest.approx(result.clip.total_norm, rel=1e-5)
    assert step.module_grad_norms == pytest.approx(module_norms, rel=1e-5)


def test_an_unnumbered_step_after_the_largest_step_number_is_a_422_and_records_nothing(bob_http):
    from gradsvc.wire import MAX_RUN_STEP

    body = {"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}]},
            "inputs": [[1.0, 2.0]], "targets": [1], "options": {"numcheck": "off"},
            "run": {"name": "at-the-top", "step": MAX_RUN_STEP}}
    assert bob_http.post("/gradients", json=body).status_code == 200
    body["run"] = {"name": "at-the-top"}
    r = bob_http.post("/gradients", json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_option" and error["detail"]["option"] == "run.step"
    assert str(MAX_RUN_STEP) in error["message"]
    assert [s["step"] for s in bob_http.get("/runs/at-the-top").json()["steps"]] == [MAX_RUN_STEP]
    bob_http.delete("/runs/at-the-top")
