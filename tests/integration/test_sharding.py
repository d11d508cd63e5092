"""options.shards through the live stack: a private redis-server, the API over HTTP and two real RQ
workers. Sharded results equal unsharded ones; a failed, canceled or lost shard ends the one job the
caller sees and leaves no shard queued or running."""

from __future__ import annotations

import copy
import os
import signal
import time

import httpx
import pytest
import torch
from redis import Redis
from rq.job import Job

from gradsvc.broker import keys

from tests.support.nets import SEED_A_LAYERS, TWO_LOSSES, from_wire, tensor_json
from tests.support.stack import client_fixtures, module_stack, wait_started, wait_status

HEARTBEAT_S = 2  # a job's lease is 3 heartbeats: 6 s
TERMINAL = ("finished", "failed", "canceled")
N = 23  # divides by none of 2, 3, 7
REL = 1e-12


shard_stack = module_stack(2, GRADSVC_WORKER_HEARTBEAT_S=str(HEARTBEAT_S), GRADSVC_MIN_SHARD_ROWS="8")


http, redis = client_fixtures("shard_stack")


def body(loss=None, losses=None, n: int = N, **options) -> dict:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    teacher = torch.softmax(torch.randn(n, 3, generator=g, dtype=torch.float64), 1)
    out = {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
           "inputs": tensor_json(x), "options": {"numcheck": "off", **options}}
    if losses is not None:
        out["losses"], out["targets"] = losses, {"label": y.tolist(), "teacher": tensor_json(teacher)}
    else:
        out["loss"], out["targets"] = loss or "cross_entropy", tensor_json(y)
    return out


def long_body(rows: int = 12, shards: int = 3) -> dict:
    """Minutes of work per shard (an exact check of 263k parameters) that reports progress as it goes."""
    layers: list[dict] = []
    for _ in range(4):
        layers += [{"type": "Linear", "in_features": 256, "out_features": 256}, {"type": "Tanh"}]
    return {"model": {"layers": layers, "dtype": "float64", "seed": 0}, "inputs": [[0.1] * 256] * rows,
            "targets": [[0.0] * 256] * rows, "loss": "mse", "options": {"numcheck": "exact", "shards": shards}}


def post(http: httpx.Client, b: dict) -> dict:
    r = http.post("/gradients?wait=120", json=b)
    assert r.status_code == 200, r.text
    return r.json()



def assert_close(a: dict | None, b: dict | None, what: str) -> None:
    if b is None:
        assert a is None, what
        return
    ta, tb = from_wire(a).to(torch.float64), from_wire(b).to(torch.float64)
    assert ta.shape == tb.shape, what
    err = float((ta - tb).abs().max()) / max(float(tb.abs().max()), 1e-300)
    assert err <= REL, (what, err)


def assert_same(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=REL, abs=0)
    for name, g in want["gradients"].items():
        assert_close(got["gradients"][name], g, name)
    for key in ("losses",):
        if want[key] is not None:
            assert got[key] == pytest.approx(want[key], rel=REL, abs=0)
    if want["per_loss_gradients"] is not None:
        for term, grads in want["per_loss_gradients"].items():
            for name, g in grads.items():
                assert_close(got["per_loss_gradients"][term][name], g, f"{term}/{name}")
        assert got["gradient_cosine"] == pytest.approx(want["gradient_cosine"], rel=REL, abs=1e-14)
    for name, h in (want["hvp"] or {}).items():
        assert_close(got["hvp"][name], h, f"hvp {name}")
    assert_close(got["input_gradient"], want["input_gradient"], "input_gradient")
    if want["per_sample"] is not None:
        assert_close(got["per_sample"]["norms"], want["per_sample"]["norms"], "per_sample norms")
        for name, g in (want["per_sample"]["gradients"] or {}).items():
            assert_close(got["per_sample"]["gradients"][name], g, f"per_sample {name}")


CASES = {
    "mean": dict(loss="cross_entropy"),
    "sum": dict(loss={"type": "cross_entropy", "reduction": "sum"}),
    "several_losses": dict(losses=TWO_LOSSES),
    "hvp_input_grad": dict(losses=TWO_LOSSES, hvp={"vector": "random", "seed": 1}, input_grad=True),
    "per_sample": dict(loss={"type": "cross_entropy", "reduction": "sum"}, per_sample="full"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_equals_unsharded_to_1e_12_in_float64_with_2_3_and_7_shards(http, redis, shard_stack, case):
    kw = dict(CASES[case])
    want = post(http, body(kw.pop("loss", None), kw.pop("losses", None), **kw))
    assert want["shards"] is None
    for count in (2, 3, 7):
        kw = dict(CASES[case])
        got = post(http, body(kw.pop("loss", None), kw.pop("losses", None), shards=count, **kw))
        assert_same(got, want)
        assert got["shards"]["count"] == count and sum(got["shards"]["rows"]) == N
        assert got["micro_batches"] == count
        # Nothing of it is left behind: the shard results were consumed, no shard queued or running.
        ids = [f"{got['job_id']}-shard-{k}" for k in range(count)]
        assert not any(redis.exists(keys.result_key("gradsvc", sid)) for sid in ids)
        assert all(redis.hget(Job.key_for(sid), "status") == b"finished" for sid in ids)


# Lanczos jobs over the whole batch (the top eigenvalues, the density's probes, the trace from their runs); the
# Hutchinson trace alone is summed from the row shards' per-probe samples.
CURVATURE = {"lanczos": {"top": 2, "trace": True, "density": True, "probes": 3, "iterations": 10, "tolerance": 1e-8,
                         "seed": 3},
             "row_trace": {"top": 1, "trace": True, "probes": 20, "tolerance": 1e-8, "seed": 8}}


@pytest.mark.parametrize("matrix", ["hessian", "ggn"])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_sharded_curvature_equals_unsharded_for_the_same_seed(http, redis, shard_stack, model, matrix):
    from tests.gradsvc.engine.test_sharded_curvature import body as curvature_body

    for name, curvature in CURVATURE.items():
        options = {"curvature": {**curvature, "matrix": matrix}}
        want = post(http, curvature_body(model, **options))["curvature"]
        for count in (2, 3):
            got = post(http, curvature_body(model, shards=count, **options))
            c = got["curvature"]
            assert c["top_eigenvalues"] == pytest.approx(want["top_eigenvalues"], rel=1e-6), name
            assert c["trace"] == pytest.approx(want["trace"], rel=1e-10), name
            assert c["trace_samples"] == pytest.approx(want["trace_samples"], rel=1e-10), name
            assert c["trace_stderr"] == pytest.approx(want["trace_stderr"], rel=1e-8), name
            assert c["products"] == want["products"], name
            if want.get("density") is not None:
                assert c["density"]["eigenvalues"] == pytest.approx(want["density"]["eigenvalues"], rel=1e-12)
                assert c["density"]["weights"] == pytest.approx(want["density"]["weights"], rel=1e-12)
            jobs = min(count, 3) if name == "lanczos" else 1
            assert got["shards"]["count"] == count and got["shards"]["curvature_jobs"] == jobs
            ids = [f"{got['job_id']}-shard-{k}" for k in range(count + jobs)]
            assert all(redis.hget(Job.key_for(sid), "status") == b"finished" for sid in ids)
            assert not any(redis.exists(keys.result_key("gradsvc", sid)) for sid in ids)


def test_a_msgpack_request_is_sharded_from_its_raw_bytes_and_answers_the_same(http):
    import msgspec

    b = body("cross_entropy")
    want = post(http, b)
    raw = {**b, "inputs": {**b["inputs"], "data": from_wire(b["inputs"]).numpy().tobytes()}}
    raw["inputs"].pop("b64")
    raw["options"] = {**b["options"], "shards": 3}
    r = http.post("/gradients?wait=60", content=msgspec.msgpack.encode(raw),
                  headers={"Content-Type": "application/msgpack", "Accept": "application/json"})
    assert r.status_code == 200, r.text
    assert_same(r.json(), want)


def test_the_sdk_sends_shards_and_reads_back_how_the_job_ran(shard_stack):
    from gradclient import Client

    from tests.support.nets import seed_a_module

    model = seed_a_module()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)
    with Client(shard_stack.base_url) as client:
        whole = client.gradients(model, x, y, loss="cross_entropy", numcheck="off")
        split = client.gradients(model, x, y, loss="cross_entropy", numcheck="off", shards=3)
    assert whole.shards is None and split.shards.count == 3 and split.shards.rows == [8, 8, 7]
    for name, grad in whole.gradients.items():
        assert torch.allclose(split.gradients[name], grad, rtol=REL, atol=0), name


def test_the_check_judges_the_combined_gradient_against_the_whole_batchs_float64_gradient(http, redis):
    """Each shard checks its own rows; the reduced answer's returned-gradient figure is the combined
    float32 gradient against the float64 gradient of the whole batch (worked out here independently)."""
    req = body(numcheck="sampled", shards=3)
    req["model"]["dtype"] = "float32"
    r = http.post("/gradients", json=req, params={"wait": 120})
    assert r.status_code == 200, r.text
    got = r.json()
    check = got["numcheck"]
    assert got["shards"]["count"] == 3 and check["passed"] is True
    assert 0 < check["returned_max_rel_error"] <= check["returned_tolerance"] == 1e-4
    # The whole batch's float64 gradient at the float32-rounded weights, from a local model.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    x = from_wire(req["inputs"]).to(torch.float32).double()
    y = from_wire(req["targets"])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    worst = 0.0
    for name, p in model.named_parameters():
        returned = from_wire(got["gradients"][name]).double()
        scale = max(float(returned.abs().max()), float(p.grad.abs().max()), 1e-12)
        worst = max(worst, float((returned - p.grad).abs().max()) / scale)
        assert check["per_parameter"][name]["returned_max_rel_error"] <= 1e-4
    assert check["returned_max_rel_error"] == pytest.approx(worst, rel=0.05, abs=1e-9)
    assert not redis.keys("*:reference:*")  # the shards' references go with the reduce job


def test_auto_runs_one_shard_per_live_worker_of_at_least_min_shard_rows(http):
    assert post(http, body(shards="auto"))["shards"]["count"] == 2  # 2 workers, 23 rows >= 2 x 8
    assert post(http, body(n=15, shards="auto"))["shards"] is None  # 15 rows: one shard of >= 8


@pytest.mark.parametrize("options, status, code, needle", [
    ({"shards": 24}, 422, "bad_option", "exceeds the batch"), ({"shards": 0}, 400, "invalid_body", "at least 1"),
    ({"shards": 257}, 400, "invalid_body", "at most 256"), ({"shards": 2, "per_sample": "norms"}, 200, None, None)])
def test_bad_shard_counts_are_refused_before_the_queue(http, options, status, code, needle):
    r = http.post("/gradients?wait=60", json=body(**options))
    assert r.status_code == status, r.text
    if code is not None:
        assert r.json()["error"]["code"] == code and needle in r.json()["error"]["message"]


def test_batch_norm_is_refused_with_bad_option(http):
    b = body(shards=2)
    b["model"]["layers"] = [{"type": "Linear", "in_features": 6, "out_features": 8},
                            {"type": "BatchNorm1d", "num_features": 8}, {"type": "Linear", "in_features": 8,
                                                                        "out_features": 3}]
    r = http.post("/gradients", json=b)
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_option"
    assert "BatchNorm1d" in r.json()["error"]["message"]


def test_a_failed_shard_fails_the_job_with_its_code_and_index(http, redis):
    b = body("mse", shards=3)
    b["model"]["layers"] = [{"type": "Linear", "in_features": 6, "out_features": 3}]  # no squashing
    b["targets"] = [[0.0, 0.0, 0.0]] * N
    x = from_wire(b["inputs"]).clone()
    x[20] = 1e300  # row 20 lies in shard 2 (rows 16:23); its squared error overflows
    b["inputs"] = tensor_json(x)
    r = http.post("/gradients?wait=60", json=b)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "non_finite" and err["detail"]["shard"] == 2, err
    assert "shard 2 of 3 (rows 16:23)" in err["message"]
    job = http.get(f"/jobs/{r.json()['job_id']}").json()
    assert job["status"] == "failed" and job["error"]["detail"]["shard"] == 2


def _shard_ids(job_id: str, count: int) -> list[str]:
    return [f"{job_id}-shard-{k}" for k in range(count)]


def _assert_nothing_queued_or_running(redis: Redis, ids: list[str]) -> None:
    queued = set(redis.lrange("rq:queue:gradsvc", 0, -1))
    running = {m.split(b":")[0] for m in redis.zrange("rq:wip:gradsvc", 0, -1)}
    for sid in ids:
        assert sid.encode() not in queued and sid.encode() not in running, sid
        assert redis.hget(Job.key_for(sid), "status") in (b"finished", b"failed", b"canceled"), sid


def test_a_cancel_stops_every_shard_and_progress_counts_them(http, redis, shard_stack):
    from concurrent.futures import ThreadPoolExecutor

    def waiting_post() -> httpx.Response:
        with httpx.Client(base_url=shard_stack.base_url, timeout=120) as client:
            return client.post("/gradients?wait=60", json=long_body(shards=3))

    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(waiting_post)
        deadline = time.monotonic() + 30
        while not redis.zcard("rq:deferred:gradsvc") and time.monotonic() < deadline:
            time.sleep(0.1)
        job_id = redis.zrange("rq:deferred:gradsvc", 0, -1)[0].decode()
        job = wait_status(http, job_id, ("started",))
        assert job.get("status") == "started" and job["progress"] == {"phase": "shards", "done": 0, "total": 3}
        t0 = time.monotonic()
        assert http.post(f"/jobs/{job_id}/cancel").json()["status"] == "canceled"
        answer = waiting.result(timeout=30)  # the waiting POST wakes at once, as for a running job
        print(f"waiting POST answered {time.monotonic() - t0:.2f} s after the cancel")
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "canceled", answer.text
    ids = _shard_ids(job_id, 3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(redis.hget(Job.key_for(s), "status") in (b"queued", b"started")
                                              for s in ids):
        time.sleep(0.2)
    print(f"every shard stopped {time.monotonic() - t0:.2f} s after the cancel")
    _assert_nothing_queued_or_running(redis, ids)
    job = http.get(f"/jobs/{job_id}").json()
    assert job["status"] == "canceled" and job["error"]["code"] == "canceled"


def test_worker_metrics_label_shard_and_reduce_jobs(shard_stack, http):
    post(http, body(shards=2))
    text = "".join(httpx.get(f"http://127.0.0.1:{shard_stack.metrics_port + i}/metrics").text for i in range(2))
    assert 'kind="shard"' in text and 'kind="reduce"' in text


def test_a_killed_shard_worker_ends_the_job_worker_lost_naming_the_shard_and_cancels_the_rest(
        http, redis, shard_stack):
    """Last in this module: it kills one of the stack's two workers (and starts a new one)."""
    r = http.post("/gradients?wait=0", json=long_body(shards=3))
    job_id = r.json()["job_id"]
    ids = _shard_ids(job_id, 3)
    running = wait_started(redis, ids, 2)
    assert len(running) == 2, "two shards should run on the two workers"
    victim_shard = running[0]
    worker_name = redis.hget(Job.key_for(victim_shard), "worker_name").decode()
    pid = int(worker_name.split("-")[-2])
    assert pid in {p.pid for p in shard_stack.workers}
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    job = wait_status(http, job_id, TERMINAL, 60)
    print(f"job ended {time.monotonic() - t0:.2f} s after kill -9 of its shard's worker")
    index = int(victim_shard.rsplit("-", 1)[1])
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", job
    assert job["error"]["detail"]["shard"] == index and f"shard {index} of 3" in job["error"]["message"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(redis.hget(Job.key_for(s), "status") in (b"queued", b"started")
                                              for s in ids):
        time.sleep(0.2)
    _assert_nothing_queued_or_running(redis, ids)
    for sid in ids:
        if sid != victim_shard:  # canceled while queued (RQ's canceled) or stopped while running (code canceled)
            status = redis.hget(Job.key_for(sid), "status")
            meta = Job.fetch(sid, connection=redis, serializer="gradsvc.broker.job.MsgpackSerializer").meta
            assert status == b"canceled" or meta.get("error", {}).get("code") == "canceled", (sid, status, meta)
    shard_stack.start_worker()
