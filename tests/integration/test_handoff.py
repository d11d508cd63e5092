"""Large payloads handed over outside Redis (GRADSVC_HANDOFF_DIR, gradsvc/broker/handoff.py) through the live stack:
a private redis-server, the API over HTTP and two real RQ workers sharing a handoff dir, with a small
GRADSVC_HANDOFF_MIN_BYTES. The answers equal local float64 autograd; Redis holds refs, not bodies; nothing
is left behind by sharded, canceled or killed jobs; a worker outside the domain turns the handoff off."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
from redis import Redis
from rq.job import Job

from gradsvc.broker import handoff as hf
from gradsvc.broker import keys

from tests.support.stack import ROOT, client_fixtures, start_stack, wait_started, wait_status

MIN_BYTES = 4096
REL = 1e-12
TERMINAL = ("finished", "failed", "canceled")
N, D_IN, HIDDEN, D_OUT = 64, 32, 64, 32
MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


@pytest.fixture(scope="module")
def handoff_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("handoff") / "dir"


@pytest.fixture(scope="module")
def hstack(handoff_dir):
    s = start_stack(workers=2, GRADSVC_HANDOFF_DIR=str(handoff_dir), GRADSVC_HANDOFF_MIN_BYTES=str(MIN_BYTES),
                    GRADSVC_MIN_SHARD_ROWS="8", GRADSVC_WORKER_HEARTBEAT_S="2")
    yield s
    s.stop()


http, redis = client_fixtures("hstack")


def domain(handoff_dir: Path) -> str:
    return (handoff_dir / "domain").read_text().strip()


def files_of(handoff_dir: Path, ids: list[str]) -> list[str]:
    return sorted(n for n in os.listdir(handoff_dir) for i in ids if n.startswith(f"{i}."))


def raw(t: torch.Tensor) -> dict:
    t = t.contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.numpy().tobytes()}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(N, D_IN, generator=g, dtype=torch.float64), torch.randn(N, D_OUT, generator=g,
                                                                                 dtype=torch.float64)


def body(**options) -> bytes:
    """A float64 MLP whose body (32 KB) and result (33 KB) are both above MIN_BYTES, as MessagePack."""
    x, y = batch()
    layers = [{"type": "Linear", "in_features": D_IN, "out_features": HIDDEN}, {"type": "Tanh"},
              {"type": "Linear", "in_features": HIDDEN, "out_features": D_OUT}]
    return msgspec.msgpack.encode({"model": {"layers": layers, "dtype": "float64", "seed": 0}, "inputs": raw(x),
                                   "targets": raw(y), "loss": "mse", "options": {"numcheck": "off", **options}})


def local_gradients() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the service's model.seed: the same initial weights
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, D_OUT)).double()
    x, y = batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def wire_tensor(t: dict) -> torch.Tensor:
    import base64

    if "b64" in t:
        data = base64.b64decode(t["b64"])
    else:
        data = t["data"]
    if isinstance(data, list):
        return torch.tensor(data, dtype=torch.float64).reshape(t["shape"])
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, t["dtype"])).reshape(t["shape"])


def assert_gradients(answer: dict, want: dict[str, torch.Tensor]) -> None:
    assert set(answer["gradients"]) == set(want)
    for name, g in want.items():
        got = wire_tensor(answer["gradients"][name])
        err = float((got - g).abs().max()) / float(g.abs().max())
        assert err <= REL, (name, err)


def post(http: httpx.Client, content: bytes, accept: str = "application/msgpack", wait: float = 120) -> httpx.Response:
    return http.post("/gradients", params={"wait": wait}, content=content,
                     headers={"Content-Type": "application/msgpack", "Accept": accept})



def long_body(shards: int) -> bytes:
    """Minutes of work per shard (an exact check of 263k parameters), a body above MIN_BYTES."""
    layers: list[dict] = []
    for _ in range(4):
        layers += [{"type": "Linear", "in_features": 256, "out_features": 256}, {"type": "Tanh"}]
    return msgspec.msgpack.encode({"model": {"layers": layers, "dtype": "float64", "seed": 0},
                                   "inputs": raw(torch.full((12, 256), 0.1, dtype=torch.float64)),
                                   "targets": raw(torch.zeros(12, 256, dtype=torch.float64)), "loss": "mse",
                                   "options": {"numcheck": "exact", "shards": shards}})


def test_a_large_job_passes_through_files_and_equals_local_float64_autograd(http, redis, handoff_dir):
    content = body()
    r = post(http, content)
    assert r.status_code == 200, r.content[:300]
    answer = msgspec.msgpack.decode(r.content)
    want = local_gradients()
    assert_gradients(answer, want)
    job_id = answer["job_id"]
    # Redis held the ref, not the body: the job came through the domain's queue with a small `data`.
    dom = domain(handoff_dir)
    assert redis.hget(Job.key_for(job_id), "origin") == f"gradsvc@{dom}".encode()
    assert len(redis.hget(Job.key_for(job_id), "data")) < 400 < MIN_BYTES < len(content)
    # The result key holds a marker; its file is there, the body's is gone (the worker read and deleted it).
    stored = redis.get(keys.result_key("gradsvc", job_id))
    assert stored.startswith(hf.MARKER) and len(stored) < 200
    assert files_of(handoff_dir, [job_id]) == [f"{job_id}.out"]
    assert redis.ttl(keys.result_key("gradsvc", job_id)) > 3000
    # GET /jobs/{id}, twice, in JSON and in MessagePack; a POST answered in JSON.
    for _ in range(2):
        got = http.get(f"/jobs/{job_id}")
        assert got.status_code == 200 and got.json()["status"] == "finished"
        assert_gradients(got.json()["result"], want)
        got = http.get(f"/jobs/{job_id}", headers={"Accept": "application/msgpack"})
        assert_gradients(msgspec.msgpack.decode(got.content)["result"], want)
    r = post(http, content, accept="application/json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert_gradients(r.json(), want)


def test_an_idempotency_key_over_a_large_body_names_one_job_and_leaves_no_body_file(http, handoff_dir):
    """A body of over 1 MiB: its key's digest is computed beside the write of its file. The same body again
    under the key answers the first job and deletes its own file; another body under it is a 400, with no
    file left either."""
    import uuid

    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(4200, D_IN, generator=g, dtype=torch.float64), torch.randn(4200, D_OUT, generator=g,
                                                                               dtype=torch.float64)
    layers = [{"type": "Linear", "in_features": D_IN, "out_features": D_OUT}]

    def big(scale: float) -> bytes:
        return msgspec.msgpack.encode({"model": {"layers": layers, "dtype": "float64", "seed": 0},
                                       "inputs": raw(x * scale), "targets": raw(y), "loss": "mse",
                                       "options": {"numcheck": "off"}})

    content = big(1.0)
    assert len(content) > 2 << 20
    key = {"Idempotency-Key": str(uuid.uuid4()), **MSGPACK}
    first = http.post("/gradients", params={"wait": 60}, content=content, headers=key)
    assert first.status_code == 200, first.content[:300]
    job_id = msgspec.msgpack.decode(first.content)["job_id"]
    for wait in (60, 0):
        again = http.post("/gradients", params={"wait": wait}, content=content, headers=key)
        assert again.status_code == 200 and msgspec.msgpack.decode(again.content)["job_id"] == job_id
    other = http.post("/gradients", params={"wait": 60}, content=big(2.0), headers=key)
    assert other.status_code == 422 and msgspec.msgpack.decode(other.content)["error"]["code"] == "idempotency_key_reused"
    assert [n for n in os.listdir(handoff_dir) if n.endswith(".in")] == []
    assert files_of(handoff_dir, [job_id]) == [f"{job_id}.out"]


def test_a_body_the_checks_refuse_leaves_no_file(http, handoff_dir):
    """A large body's file is written while the API checks the request (Enqueuer.start): a body the checks
    refuse (a NaN weight, bad_weights) leaves neither a job's file nor the staged one behind."""
    x, y = batch()
    layers = [{"type": "Linear", "in_features": D_IN, "out_features": HIDDEN}, {"type": "Tanh"},
              {"type": "Linear", "in_features": HIDDEN, "out_features": D_OUT}]
    nan = torch.full((HIDDEN, D_IN), float("nan"), dtype=torch.float64)
    content = msgspec.msgpack.encode({"model": {"layers": layers, "dtype": "float64", "weights": {"0.weight": raw(nan)}},
                                      "inputs": raw(x), "targets": raw(y), "loss": "mse"})
    assert len(content) > MIN_BYTES
    r = post(http, content)
    assert r.status_code == 422 and msgspec.msgpack.decode(r.content)["error"]["code"] == "bad_weights"

    def left() -> list[str]:
        return [n for n in os.listdir(handoff_dir) if n.startswith(".tmp-") or n.endswith(".in")]

    deadline = time.monotonic() + 5
    while left() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert left() == []


def test_a_small_job_still_goes_through_redis(http, redis, handoff_dir):
    tiny = {"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 1}], "dtype": "float64"},
            "inputs": [[1.0, 2.0]], "targets": [[0.5]], "loss": "mse"}
    r = http.post("/gradients?wait=60", json=tiny)
    assert r.status_code == 200, r.text
    job_id = r.json()["job_id"]
    assert redis.hget(Job.key_for(job_id), "origin") == b"gradsvc"
    assert not redis.get(keys.result_key("gradsvc", job_id)).startswith(hf.MARKER)
    assert files_of(handoff_dir, [job_id]) == []


def test_a_small_body_with_a_large_result_goes_through_the_domain_queue_and_its_result_through_a_file(
        http, redis, handoff_dir):
    small = {"model": {"layers": [{"type": "Linear", "in_features": D_IN, "out_features": HIDDEN}],
                       "dtype": "float64", "seed": 0},  # 2112 parameters: a 17 KB result
             "inputs": [[0.5] * D_IN], "targets": [[0.0] * HIDDEN], "loss": "mse", "options": {"numcheck": "off"}}
    r = http.post("/gradients?wait=60", json=small)
    assert r.status_code == 200, r.text
    job_id = r.json()["job_id"]
    assert redis.hget(Job.key_for(job_id), "origin") == f"gradsvc@{domain(handoff_dir)}".encode()
    assert b"in_features" in redis.hget(Job.key_for(job_id), "data")  # the body itself, inline
    assert redis.get(keys.result_key("gradsvc", job_id)).startswith(hf.MARKER)
    assert files_of(handoff_dir, [job_id]) == [f"{job_id}.out"]
    assert http.get(f"/jobs/{job_id}").json()["result"]["gradients"] == r.json()["gradients"]


def test_an_expired_result_file_reads_as_expired(http, handoff_dir):
    r = post(http, body())
    job_id = msgspec.msgpack.decode(r.content)["job_id"]
    (handoff_dir / f"{job_id}.out").unlink()  # as the sweep does once its TTL is over
    got = http.get(f"/jobs/{job_id}")
    assert got.status_code == 404 and got.json()["error"]["code"] == "not_found", got.text
    assert "expired" in got.json()["error"]["message"]


@pytest.mark.parametrize("count", [2, 3])
def test_a_sharded_job_through_files_equals_unsharded_and_leaves_no_shard_file(http, redis, handoff_dir, count):
    # numcheck directional: each shard keeps a float64 reference, handed back as a file too.
    r = post(http, body(numcheck="directional"))
    want = msgspec.msgpack.decode(r.content)
    r = post(http, body(numcheck="directional", shards=count))
    assert r.status_code == 200, r.content[:300]
    got = msgspec.msgpack.decode(r.content)
    assert got["shards"]["count"] == count and got["numcheck"]["passed"] is True
    assert got["loss"] == pytest.approx(want["loss"], rel=REL, abs=0)
    assert_gradients(got, {n: wire_tensor(t) for n, t in want["gradients"].items()})
    assert_gradients(got, local_gradients())
    assert 0 <= got["numcheck"]["returned_max_rel_error"] <= 1e-12  # against the combined float64 references
    job_id = got["job_id"]
    ids = [f"{job_id}-shard-{k}" for k in range(count)]
    dom = domain(handoff_dir)
    for sid in ids:
        assert redis.hget(Job.key_for(sid), "origin") == f"gradsvc@{dom}".encode()
        assert len(redis.hget(Job.key_for(sid), "data")) < 400
    assert redis.hget(Job.key_for(job_id), "origin") == f"gradsvc@{dom}".encode()  # the reduce job too
    assert files_of(handoff_dir, ids) == []  # bodies read, results and references deleted by the reduce job
    assert not any(redis.exists(keys.result_key("gradsvc", s), keys.reference_key("gradsvc", s)) for s in ids)
    assert files_of(handoff_dir, [job_id]) == [f"{job_id}.out"]


def _busy_workers(http: httpx.Client, redis: Redis) -> str:
    """Both workers busy with the two shards of a long job; returns its id."""
    r = post(http, long_body(shards=2), wait=0)
    assert r.status_code == 202, r.content[:300]
    job_id = msgspec.msgpack.decode(r.content)["job_id"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(redis.hget(Job.key_for(f"{job_id}-shard-{k}"), "status") == b"started" for k in range(2)):
            return job_id
        time.sleep(0.1)
    raise AssertionError("the long job's shards did not start")


def test_cancel_deletes_a_queued_body_and_a_missing_body_fails_input_lost_while_the_worker_lives(
        http, redis, handoff_dir, hstack):
    long_id = _busy_workers(http, redis)
    try:
        queued = [msgspec.msgpack.decode(post(http, body(), wait=0).content)["job_id"] for _ in range(2)]
        assert all(files_of(handoff_dir, [j]) == [f"{j}.in"] for j in queued)
        # The cancel of a queued job: its body goes at once.
        r = http.post(f"/jobs/{queued[0]}/cancel")
        assert r.json()["status"] == "canceled" and files_of(handoff_dir, [queued[0]]) == []
        # A body gone before a worker takes the job (swept, the dir cleared): the job fails input_lost.
        (handoff_dir / f"{queued[1]}.in").unlink()
    finally:
        assert http.post(f"/jobs/{long_id}/cancel").json()["status"] == "canceled"
    job = wait_status(http, queued[1])
    assert job["status"] == "failed" and job["error"]["code"] == "input_lost", job
    assert "GRADSVC_HANDOFF_DIR" in job["error"]["message"]
    # The long job's files: the running shards' bodies were read; nothing of it is left.
    deadline = time.monotonic() + 30
    ids = [long_id, f"{long_id}-shard-0", f"{long_id}-shard-1"]
    while files_of(handoff_dir, ids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert files_of(handoff_dir, ids) == []
    # Both workers live on: the next jobs succeed.
    assert all(p.poll() is None for p in hstack.workers)
    for _ in range(2):
        assert post(http, body()).status_code == 200


def test_a_killed_shard_worker_leaves_no_file_behind(http, redis, handoff_dir, hstack):
    """Kills one worker (and starts another in its place)."""
    r = post(http, long_body(shards=3), wait=0)
    job_id = msgspec.msgpack.decode(r.content)["job_id"]
    ids = [f"{job_id}-shard-{k}" for k in range(3)]
    running = wait_started(redis, ids, 2)
    assert len(running) == 2
    queued = [s for s in ids if s not in running]
    assert files_of(handoff_dir, queued) == [f"{queued[0]}.in"]  # the third shard's body waits
    pid = int(redis.hget(Job.key_for(running[0]), "worker_name").decode().split("-")[-2])
    os.kill(pid, signal.SIGKILL)
    job = wait_status(http, job_id, TERMINAL, 60)
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", job
    deadline = time.monotonic() + 30
    while files_of(handoff_dir, [job_id, *ids]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert files_of(handoff_dir, [job_id, *ids]) == []
    # And a sweep (as the API and the workers run it) leaves what is within its TTL.
    before = set(os.listdir(handoff_dir))
    hf.Handoff(handoff_dir).sweep(hf.sweep_ages(3600, 86400))
    assert set(os.listdir(handoff_dir)) == before
    hstack.workers = [p for p in hstack.workers if p.pid != pid]
    hstack.start_worker(index=2)
    hstack.wait_ready(2)


def test_a_worker_outside_the_domain_turns_the_handoff_off_and_jobs_still_succeed(http, redis, handoff_dir,
                                                                                 hstack, tmp_path):
    """Last: a third worker with another GRADSVC_HANDOFF_DIR (another domain, as on another host)."""
    log = open(tmp_path / "other-worker.log", "ab")
    other = subprocess.Popen([sys.executable, "-m", "gradsvc", "worker", "--index", "3"], cwd=ROOT, stdout=log,
                             stderr=subprocess.STDOUT,
                             env={**hstack.env, "GRADSVC_HANDOFF_DIR": str(tmp_path / "elsewhere")})
    try:
        hstack.wait_ready(3)
        time.sleep(1.2)  # the API's look at the workers is cached a second
        want = local_gradients()
        for _ in range(3):  # whichever worker takes them
            r = post(http, body())
            assert r.status_code == 200, r.content[:300]
            answer = msgspec.msgpack.decode(r.content)
            assert_gradients(answer, want)
            job_id = answer["job_id"]
            origin = redis.hget(Job.key_for(job_id), "origin")
            # the plain queue (or the own queue of the worker holding the model: affinity), body inline
            assert origin == b"gradsvc" or origin.startswith(keys.own_queue_name("gradsvc", "").encode()), origin
            assert len(redis.hget(Job.key_for(job_id), "data")) > MIN_BYTES
            assert not redis.get(keys.result_key("gradsvc", job_id)).startswith(hf.MARKER)
            assert files_of(handoff_dir, [job_id]) == []
        r = post(http, body(shards=3))
        assert r.status_code == 200
        assert files_of(handoff_dir, [msgspec.msgpack.decode(r.content)["job_id"]]) == []
    finally:
        other.send_signal(signal.SIGTERM)
        other.wait(timeout=30)
    time.sleep(1.2)
    r = post(http, body())  # the other domain's worker has gone: handed off again
    job_id = msgspec.msgpack.decode(r.content)["job_id"]
    assert redis.hget(Job.key_for(job_id), "origin") == f"gradsvc@{domain(handoff_dir)}".encode()


def test_gradsvc_up_hands_off_in_a_per_port_dir_and_removes_it_at_exit(tmp_path):
    """`gradsvc up` sets GRADSVC_HANDOFF_DIR for its children (launcher.handoff_dir) and removes it on Ctrl-C."""
    from gradsvc.runtime.launcher import free_port, handoff_dir as up_dir

    port = free_port()
    path = up_dir(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSVC_")}
    env.update(GRADSVC_WORKER_METRICS_PORT=str(free_port()), GRADSVC_LOG_LEVEL="warning")
    proc = subprocess.Popen([sys.executable, "-m", "gradsvc", "up", "--port", str(port), "--workers", "1"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert (path / "domain").exists() and int((path / "launcher.pid").read_text()) == proc.pid
        # A 1 MiB layer: its gradients (the result) are above the default GRADSVC_HANDOFF_MIN_BYTES.
        x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
        content = msgspec.msgpack.encode({"model": {"layers": [{"type": "Linear", "in_features": 512,
                                                                "out_features": 512}], "dtype": "float32"},
                                          "inputs": raw(x), "targets": raw(torch.zeros(4, 512)), "loss": "mse",
                                          "options": {"numcheck": "off"}})
        r = httpx.post(f"{base}/gradients?wait=60", content=content, headers=MSGPACK, timeout=90)
        assert r.status_code == 200, r.content[:300]
        job_id = msgspec.msgpack.decode(r.content)["job_id"]
        assert files_of(path, [job_id]) == [f"{job_id}.out"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert not path.exists()
