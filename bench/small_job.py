"""Small job end to end: the 6-8-3 tanh float64 net (83 parameters, batch 4), POST
/gradients with a sync wait, against the same request computed in this process.

A private stack (tests/support/stack.py: redis-server, the API on uvicorn, one worker) on loopback; one
httpx client with keep-alive sends the requests one after another.
  in-process  gradsvc.engine.compute() on the same request, decoded as the worker decodes it, run
              just before each request (interleaved, so load from other processes hits both).
  e2e         client-side wall time of POST /gradients?wait=30 to the parsed 200 answer.
  overhead    e2e p50 (p99) minus in-process p50 (the goal: at most 6 ms at p50): what HTTP +
              validation + Redis + RQ + (de)serialising add; also the median of per-round
              differences, and the median of e2e minus the worker's own timings.total_ms.

Run: .venv/bin/python bench/small_job.py
"""

from __future__ import annotations

import time

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import msgspec
import torch

from common import footer, header, median, percentile, seed_a_body, start_stack, table, verdict
from gradsvc.engine import Engine, EngineConfig
from gradsvc.wire import GradientRequest

REQUESTS = 300
WARMUP = 30
VARIANTS = [  # name, options, answer as MessagePack
    ("JSON, default options (numcheck exact, memory on)", {}, False),
    ("JSON, numcheck off", {"numcheck": "off"}, False),
    ("MessagePack, numcheck off", {"numcheck": "off"}, True),
]


def run_variant(client: httpx.Client, body: dict, binary: bool) -> dict[str, list[float]]:
    """Interleaved: each round computes in process, then sends the same request, so load from other
    processes shifts both alike."""
    content = msgspec.json.encode(body)
    req = msgspec.json.decode(content, type=GradientRequest)
    engine, cpu = Engine(EngineConfig()), torch.device("cpu")
    headers = {"Content-Type": "application/json"}
    if binary:
        headers["Accept"] = "application/msgpack"
    decode = msgspec.msgpack.decode if binary else msgspec.json.decode
    out: dict[str, list[float]] = {"local": [], "e2e": [], "worker": []}
    for i in range(WARMUP + REQUESTS):
        t0 = time.perf_counter()
        engine.compute(req, device=cpu)
        t1 = time.perf_counter()
        r = client.post("/gradients", params={"wait": 30}, content=content, headers=headers)
        answer = decode(r.content)
        t2 = time.perf_counter()
        assert r.status_code == 200, r.text
        if i >= WARMUP:
            out["local"].append(1e3 * (t1 - t0))
            out["e2e"].append(1e3 * (t2 - t1))
            out["worker"].append(answer["timings"]["total_ms"])
    return out


def main() -> list[list]:
    started = header("Small job: the 6-8-3 tanh net end to end (sync wait) vs in-process compute", __doc__.split("Run:")[0])
    stack = start_stack(workers=1)
    rows = []
    try:
        with httpx.Client(base_url=stack.base_url, timeout=60, headers=stack.auth_headers()) as client:
            for name, options, binary in VARIANTS:
                m = run_variant(client, seed_a_body(options), binary)
                local, e2e = median(m["local"]), m["e2e"]
                p50, p99 = median(e2e), percentile(e2e, 99)
                rows.append([name, local, p50, p99, p50 - local, p99 - local,
                             median([a - b for a, b in zip(e2e, m["local"])]),
                             median([a - b for a, b in zip(e2e, m["worker"])])])
    finally:
        stack.stop()
    table(["request", "in-process p50 ms", "e2e p50 ms", "e2e p99 ms", "p50 - in-process", "p99 - in-process",
           "median of pairs e2e - in-process", "median e2e - worker total_ms"], rows)
    overhead = rows[0][4]
    print(f"\ngoal p50 - in-process <= 6 ms (default options): {overhead:.2f} ms ({verdict(overhead, 6.0)}); "
          f"{REQUESTS} requests per row after {WARMUP} warm-up")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
