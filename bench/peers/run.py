"""gradsvc against the stack a user would write instead: FastAPI + Celery + Redis with solo-pool torch
workers (bench/peers/peer_app.py, peer_tasks.py), on the same workloads, in one run, ratios printed.

  small job   the 6-8-3 tanh net (float64, batch 4), JSON, one keep-alive client, requests one
              after another, one worker per side: e2e p50 and p99 (bench/small_job.py's workload).
  tiny load   the same job from 32 client threads, each POST /gradients?wait=30 one after another, two
              workers per side (GRADSVC_WORKERS=2; two solo-pool Celery workers on one torch thread
              each): requests/s and p99 (bench/summary.py's throughput row).
  medium job  8 x (Linear(1024,1024)+ReLU), batch 256, float32, MSE, MessagePack both ways (raw tensor
              bytes; 36 MB up, 33.6 MB down), one worker per side: e2e p50 (bench/medium_job.py).

Both sides get the same request bodies and compute the same gradients (checked: loss and gradients
equal), with the same numerical-check setting: none (gradsvc `numcheck: "off"`, `memory: false`).
What differs: gradsvc validates every body and meta-checks its shapes before queueing, enforces limits,
keeps RQ's job records, leases and a result TTL, and hands large payloads over as files (as `gradsvc up`
does); the peer passes the body through undecoded to the worker and back. Each side's small and medium
requests alternate in blocks, and the tiny-load runs alternate gradsvc, peer, gradsvc, peer, so drifting
load from other processes hits both.

Run: .venv/bin/python bench/peers/run.py   (needs the bench extra: pip install -e '.[bench]')
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402,F401  (puts the repo on sys.path)
import httpx  # noqa: E402
import msgspec  # noqa: E402
import torch  # noqa: E402

from common import (ROOT, concurrent_posts, footer, header, median, percentile, raw_tensor, seed_a_body,  # noqa: E402
                    start_stack, table, wide_stack_layers)
from gradsvc.runtime.launcher import free_port, wait_port  # noqa: E402
from tests.support.stack import RedisServer  # noqa: E402

HERE = Path(__file__).resolve().parent
SMALL, SMALL_WARMUP, SMALL_BLOCK = 200, 20, 50
TINY_CLIENTS, TINY_PER_CLIENT = 32, 20
MEDIUM, MEDIUM_WARMUP = 8, 2
OPTIONS = {"numcheck": "off", "memory": False}


class Peer:
    """redis-server, N solo-pool Celery workers, the FastAPI app on uvicorn."""

    def __init__(self, workers: int, threads: int | None) -> None:
        self.redis = RedisServer(free_port()).start()
        self.port = free_port()
        self.logdir = Path(tempfile.mkdtemp(prefix="gradsvc-peer-"))
        env = {**os.environ, "PEER_REDIS_URL": self.redis.url, "PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}"}
        if threads:
            env["PEER_TORCH_THREADS"] = str(threads)
        self.procs = [self._start([sys.executable, "-m", "celery", "-A", "peer_tasks", "worker", "--pool=solo",
                                   "--concurrency=1", "--without-gossip", "--without-mingle",
                                   "--without-heartbeat", "--loglevel=WARNING", "-n", f"peer{i}@%h"],
                                  env, f"worker-{i}") for i in range(workers)]
        self.procs.append(self._start([sys.executable, "-m", "uvicorn", "peer_app:app", "--app-dir", str(HERE),
                                       "--port", str(self.port), "--log-level", "warning", "--no-access-log"],
                                      env, "api"))
        wait_port(self.port, 60)
        self.base_url = f"http://127.0.0.1:{self.port}"
        with httpx.Client(base_url=self.base_url, timeout=60) as c:  # every worker up and answering
            for _ in range(4 * workers):
                assert c.post("/gradients", content=msgspec.json.encode(seed_a_body(OPTIONS))).status_code == 200

    def _start(self, cmd: list[str], env: dict, name: str) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        return subprocess.Popen(cmd, env=env, cwd=HERE, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        self.redis.stop()


def small_block(base_url: str, content: bytes, n: int) -> tuple[list[float], bytes]:
    out = []
    with httpx.Client(base_url=base_url, timeout=60, headers={"Content-Type": "application/json"}) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.post("/gradients", params={"wait": 30}, content=content)
            msgspec.json.decode(r.content)
            out.append(1e3 * (time.perf_counter() - t0))
            assert r.status_code == 200, r.text[:300]
    return out, r.content


def tiny_load(base_url: str, content: bytes) -> dict[str, float]:
    return concurrent_posts(base_url, content, TINY_CLIENTS, TINY_PER_CLIENT)


def medium_body() -> bytes:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 1024, generator=g), torch.randn(256, 1024, generator=g)
    return msgspec.msgpack.encode({"model": {"layers": wide_stack_layers(8, 1024), "dtype": "float32", "seed": 0},
                                   "inputs": raw_tensor(x), "targets": raw_tensor(y), "loss": "mse",
                                   "options": OPTIONS})


def medium_one(c: httpx.Client, content: bytes) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = c.post("/gradients", params={"wait": 120}, content=content)
    answer = msgspec.msgpack.decode(r.content)
    grads = {n: torch.frombuffer(t["data"], dtype=torch.float32).reshape(t["shape"])
             for n, t in answer["gradients"].items()}
    assert r.status_code == 200 and len(grads) == 16, r.content[:300]
    return 1e3 * (time.perf_counter() - t0), {"loss": answer["loss"], **grads}


def same(a: dict, b: dict) -> float:
    """The largest absolute difference between two answers' gradients (and losses)."""
    worst = abs(a["loss"] - b["loss"])
    for n, t in a.items():
        if n != "loss":
            worst = max(worst, float((t - b[n]).abs().max()))
    return worst


def json_answer(raw: bytes) -> dict:
    answer = msgspec.json.decode(raw)
    return {"loss": answer["loss"], **{n: torch.tensor(t["data"]) for n, t in answer["gradients"].items()}}


def one_worker(rows: list[list]) -> None:
    small = msgspec.json.encode(seed_a_body(OPTIONS))
    medium = medium_body()
    svc, peer = start_stack(workers=1, handoff=True), Peer(workers=1, threads=None)
    sides = {"gradsvc": svc.base_url, "peer": peer.base_url}
    try:
        lat: dict[str, list[float]] = {k: [] for k in sides}
        last = {}
        for side, url in sides.items():
            small_block(url, small, SMALL_WARMUP)
        for _ in range(SMALL // SMALL_BLOCK):
            for side, url in sides.items():
                got, last[side] = small_block(url, small, SMALL_BLOCK)
                lat[side] += got
        small_diff = same(json_answer(last["gradsvc"]), json_answer(last["peer"]))
        med: dict[str, list[float]] = {k: [] for k in sides}
        answers = {}
        headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
        clients = {k: httpx.Client(base_url=u, timeout=300, headers=headers) for k, u in sides.items()}
        try:
            for i in range(MEDIUM_WARMUP + MEDIUM):
                for side, c in clients.items():
                    ms, answers[side] = medium_one(c, medium)
                    if i >= MEDIUM_WARMUP:
                        med[side].append(ms)
        finally:
            for c in clients.values():
                c.close()
        medium_diff = same(answers["gradsvc"], answers["peer"])
    finally:
        svc.stop()
        peer.stop()
    g50, p50 = median(lat["gradsvc"]), median(lat["peer"])
    rows.append(["small job e2e p50 ms (lower is better)", g50, p50, g50 / p50, f"{small_diff:.1e}"])
    g99, p99 = percentile(lat["gradsvc"], 99), percentile(lat["peer"], 99)
    rows.append(["small job e2e p99 ms", g99, p99, g99 / p99, ""])
    gm, pm = median(med["gradsvc"]), median(med["peer"])
    rows.append(["medium job e2e p50 ms (lower is better)", gm, pm, gm / pm, f"{medium_diff:.1e}"])


def two_workers(rows: list[list]) -> None:
    tiny = msgspec.json.encode(seed_a_body(OPTIONS))
    svc, peer = start_stack(workers=2, handoff=True, GRADSVC_WORKERS="2"), Peer(workers=2, threads=1)
    runs: dict[str, list[dict]] = {"gradsvc": [], "peer": []}
    try:
        for _ in range(2):
            runs["gradsvc"].append(tiny_load(svc.base_url, tiny))
            runs["peer"].append(tiny_load(peer.base_url, tiny))
    finally:
        svc.stop()
        peer.stop()
    g, p = (median([r["rps"] for r in runs[k]]) for k in ("gradsvc", "peer"))
    rows.append([f"tiny load, {TINY_CLIENTS} clients, 2 workers: requests/s (higher is better)", g, p, g / p,
                 "runs " + " / ".join(", ".join(f"{r['rps']:.0f}" for r in runs[k]) for k in ("gradsvc", "peer"))])
    g, p = (median([r["p99"] for r in runs[k]]) for k in ("gradsvc", "peer"))
    rows.append(["tiny load p99 ms", g, p, g / p, ""])


def main() -> list[list]:
    started = header("Peers: gradsvc against FastAPI + Celery + Redis (solo-pool torch workers)",
                     __doc__.split("Run:")[0])
    rows: list[list] = []
    one_worker(rows)
    two_workers(rows)
    counts = (f"small: {SMALL} requests per side after {SMALL_WARMUP} warm-up; medium: {MEDIUM} per side after "
              f"{MEDIUM_WARMUP}; tiny load: {TINY_CLIENTS} x {TINY_PER_CLIENT} requests, two runs per side (median)")
    table(["figure", "gradsvc", "peer", "gradsvc / peer", "max |difference| (or runs)"], rows)
    print("\n" + counts)
    footer(started)
    return rows


if __name__ == "__main__":
    main()
