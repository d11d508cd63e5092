"""The request path's goals in one run: each figure of the request path against its goal, with the in-process
reference measured in the same run (interleaved with the requests, so load from other processes hits both).

  small job      the 6-8-3 tanh net (float64, batch 4), numcheck off, memory off, JSON, POST
                 /gradients?wait=30 on one keep-alive httpx client, one worker: e2e p50 minus the p50 of
                 gradsvc.engine.compute() on the same request in this process.   goal <= +3 ms
  validation     POST /estimate p50 for that spec (seen before) minus GET /healthz p50.   goal <= 0.3 ms
  worker         the small job's timings.total_ms (the worker's compute()), p50.   goal <= 0.7 ms
  medium SDK     8 x (Linear(1024,1024)+ReLU), batch 256, float32, MSE, numcheck off, memory off, sent
                 as an nn.Module through gradclient.Client (MessagePack): e2e p50 vs plain PyTorch
                 forward+backward in this process; payload GB/s = (weights + inputs + targets up,
                 gradients down) / (e2e - in-process).   goal >= 1 GB/s
  medium JSON    the same job, the SDK's JSON body (base64 tensors) posted with plain httpx, answer in
                 MessagePack (Accept): e2e p50 / in-process.   (no goal; shows the SDK against httpx)
  throughput     tiny jobs (the 6-8-3 tanh net, numcheck sampled), 2 workers (GRADSVC_WORKERS=2), 32 client
                 threads each POST /gradients?wait=30 one after another: requests/s and p99 latency.
                 goal >= 400 requests/s, p99 <= 200 ms

Run: .venv/bin/python bench/summary.py [--quick]
"""

from __future__ import annotations

import sys
import time
import warnings

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from common import Stack, concurrent_posts, footer, header, median, percentile, seed_a_body, start_stack, table, verdict
from gradclient import Client
from gradclient.request import Call
from gradsvc.engine import Engine, EngineConfig
from gradsvc.wire import GradientRequest

warnings.filterwarnings("ignore", message="The given buffer is not writable")  # read-only answer bytes, only read
QUICK = "--quick" in sys.argv[1:]
SMALL_N, SMALL_WARMUP = (100, 20) if QUICK else (300, 30)
MEDIUM_N = 3 if QUICK else 8
TP_CLIENTS, TP_PER_CLIENT = 32, (8 if QUICK else 20)
DEPTH, WIDTH, BATCH = 8, 1024, 256
MEDIUM_OPTIONS = {"numcheck": "off", "memory": False}


def small(stack: Stack) -> dict[str, float]:
    body = seed_a_body({"numcheck": "off", "memory": False})
    content = msgspec.json.encode(body)
    req = msgspec.json.decode(content, type=GradientRequest)
    engine, cpu = Engine(EngineConfig()), torch.device("cpu")
    headers = {"Content-Type": "application/json"}
    local, e2e, worker, health, est = [], [], [], [], []
    with httpx.Client(base_url=stack.base_url, timeout=60, headers=stack.auth_headers()) as client:
        for i in range(SMALL_WARMUP + SMALL_N):
            t0 = time.perf_counter()
            engine.compute(req, device=cpu)
            t1 = time.perf_counter()
            r = client.post("/gradients", params={"wait": 30}, content=content, headers=headers)
            answer = msgspec.json.decode(r.content)
            t2 = time.perf_counter()
            h = client.get("/healthz")
            t3 = time.perf_counter()
            e = client.post("/estimate", content=content, headers=headers)
            t4 = time.perf_counter()
            assert r.status_code == 200 and h.status_code == 200 and e.status_code == 200, (r.text, e.text)
            if i >= SMALL_WARMUP:
                local.append(1e3 * (t1 - t0))
                e2e.append(1e3 * (t2 - t1))
                worker.append(answer["timings"]["total_ms"])
                health.append(1e3 * (t3 - t2))
                est.append(1e3 * (t4 - t3))
    return {"local": median(local), "e2e": median(e2e), "e2e_p99": percentile(e2e, 99), "worker": median(worker),
            "healthz": median(health), "estimate": median(est)}


def medium(stack: Stack) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
    params = list(model.parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    moved = 2 * param_bytes + x.numel() * 4 + y.numel() * 4  # weights, inputs, targets up; gradients down
    local, sdk, plain = [], [], []
    api_key = stack.auth_headers().get("Authorization", "").removeprefix("Bearer ") or None
    with Client(stack.base_url, api_key=api_key, timeout=300) as c, \
            Client(stack.base_url, api_key=api_key, timeout=300, wire_format="json") as cj, \
            httpx.Client(base_url=stack.base_url, timeout=300, headers=stack.auth_headers()) as h:
        json_body = cj._prepare(Call(model, x, y, "mse", seed=0, options=dict(MEDIUM_OPTIONS))).content
        headers = {"Content-Type": "application/json", "Accept": "application/msgpack"}
        for i in range(MEDIUM_N + 1):
            t0 = time.perf_counter()
            torch.autograd.grad(F.mse_loss(model(x), y), params)
            t1 = time.perf_counter()
            result = c.gradients(model, x, y, loss="mse", wait_s=120, **MEDIUM_OPTIONS)
            t2 = time.perf_counter()
            r = h.post("/gradients", params={"wait": 120}, content=json_body, headers=headers)
            answer = msgspec.msgpack.decode(r.content)
            grads = [torch.frombuffer(t["data"], dtype=torch.float32) for t in answer["gradients"].values()]
            t3 = time.perf_counter()
            assert r.status_code == 200 and len(grads) == len(params) == len(result.gradients), r.content[:300]
            if i >= 1:
                local.append(1e3 * (t1 - t0))
                sdk.append(1e3 * (t2 - t1))
                plain.append(1e3 * (t3 - t2))
    lp, sp = median(local), median(sdk)
    return {"local": lp, "sdk": sp, "json": median(plain), "moved_mb": moved / 1e6,
            "gbps": moved / 1e9 / max(1e-9, (sp - lp) / 1e3)}


def throughput(stack: Stack) -> dict[str, float]:
    content = msgspec.json.encode(seed_a_body({"numcheck": "sampled"}))
    return concurrent_posts(stack.base_url, content, TP_CLIENTS, TP_PER_CLIENT, stack.auth_headers())


def main() -> list[list]:
    started = header("Summary: the request path's figures against their goals" + (" (--quick)" if QUICK else ""),
                     __doc__.split("Run:")[0])
    stack = start_stack(workers=1)
    try:
        s = small(stack)
        m = medium(stack)
    finally:
        stack.stop()
    stack = start_stack(workers=2, GRADSVC_WORKERS="2")
    try:
        throughput(stack)  # warm-up: both workers' first jobs, the API's caches
        t = throughput(stack)
    finally:
        stack.stop()
    over, valid = s["e2e"] - s["local"], s["estimate"] - s["healthz"]
    rows = [
        ["small job: e2e p50 - in-process p50 (ms)", f"{s['e2e']:.2f} - {s['local']:.2f}", over, "<= 3",
         verdict(over, 3.0)],
        ["validation: POST /estimate p50 - GET /healthz p50 (ms)", f"{s['estimate']:.2f} - {s['healthz']:.2f}",
         valid, "<= 0.3", verdict(valid, 0.3)],
        ["worker total_ms, small job p50 (ms)", f"in-process compute() {s['local']:.2f}", s["worker"], "<= 0.7",
         verdict(s["worker"], 0.7)],
        ["medium via SDK: e2e p50 / in-process f+b", f"{m['sdk']:.0f} / {m['local']:.0f} ms",
         m["sdk"] / m["local"], "", ""],
        ["medium via SDK: payload GB/s", f"{m['moved_mb']:.0f} MB / (e2e - in-process)", m["gbps"], ">= 1",
         verdict(m["gbps"], 1.0, at_most=False)],
        ["medium JSON+b64 in, MessagePack out, httpx: e2e / in-process", f"{m['json']:.0f} / {m['local']:.0f} ms",
         m["json"] / m["local"], "", ""],
        ["tiny jobs, 2 workers, 32 clients: requests/s", f"{TP_CLIENTS * TP_PER_CLIENT} requests", t["rps"],
         ">= 400", verdict(t["rps"], 400, at_most=False)],
        ["tiny jobs, 2 workers, 32 clients: p99 latency (ms)", f"p50 {t['p50']:.0f} ms", t["p99"], "<= 200",
         verdict(t["p99"], 200)],
    ]
    table(["figure", "measured from", "value", "goal", "verdict"], rows)
    print(f"\nsmall job: {SMALL_N} requests after {SMALL_WARMUP} warm-up (e2e p99 {s['e2e_p99']:.2f} ms); "
          f"medium: {MEDIUM_N} rounds after 1 warm-up")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
