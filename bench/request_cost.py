"""What one small job costs each process, in CPU time, and Redis in commands: figures that move far less
with the machine's load than wall-clock ones (on a shared 2-core machine those swing 20-50% between runs).

A private stack (tests/support/stack.py, one worker). The 6-8-3 tanh net (float64, batch 4), numcheck off,
memory off, JSON, POST /gradients?wait=30 from one keep-alive httpx client, one request after another:
  CPU ms per job   user + system CPU time of the client (this process), the API, the worker and
                   redis-server over N requests (psutil), divided by N.
  Redis commands   INFO commandstats over the same requests, divided by N: every command any process
                   sent (the API's enqueue and wait, the worker's dequeue and its RQ bookkeeping).
  validation       POST /estimate of that spec (seen before) and GET /healthz, alternating, nothing else
                   running: p50 of each and their difference (summary.py measures the same pair between
                   gradient jobs and in-process computes, with the caches the jobs leave behind).

Run: .venv/bin/python bench/request_cost.py
"""

from __future__ import annotations

import time

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import msgspec
import psutil
import redis

from common import footer, header, seed_a_body, start_stack, table

N, WARMUP = 400, 100


def main() -> None:
    started = header("Request cost: CPU per small job in each process, Redis commands per job", __doc__.split(
        "\n\n")[1].split("Run:")[0])
    stack = start_stack(workers=1)
    try:
        content = msgspec.json.encode(seed_a_body({"numcheck": "off", "memory": False}))
        headers = {"Content-Type": "application/json", **stack.auth_headers()}
        conn = redis.Redis.from_url(stack.redis.url)
        procs = {"client": psutil.Process(), "API": psutil.Process(stack.api.pid),
                 "worker": psutil.Process(stack.workers[0].pid), "redis-server": psutil.Process(stack.redis.proc.pid)}

        def cpu() -> dict[str, float]:
            return {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}

        def commands() -> dict[str, int]:
            return {k.removeprefix("cmdstat_"): v["calls"] for k, v in conn.info("commandstats").items()}

        with httpx.Client(base_url=stack.base_url, timeout=60, headers=headers) as client:
            for _ in range(WARMUP):
                client.post("/gradients", params={"wait": 30}, content=content)
            time.sleep(2.5)  # past the worker's once-a-second checks and a heartbeat
            c0, k0, t0 = cpu(), commands(), time.perf_counter()
            latencies = []
            for _ in range(N):
                t = time.perf_counter()
                r = client.post("/gradients", params={"wait": 30}, content=content)
                latencies.append(1e3 * (time.perf_counter() - t))
                assert r.status_code == 200, r.text
            wall = time.perf_counter() - t0
            c1, k1 = cpu(), commands()
            estimate, health = [], []
            for _ in range(N):
                t = time.perf_counter()
                assert client.post("/estimate", content=content).status_code == 200
                t1 = time.perf_counter()
                client.get("/healthz")
                estimate.append(1e3 * (t1 - t))
                health.append(1e3 * (time.perf_counter() - t1))
        latencies.sort()
        per_cpu = {k: 1e3 * (c1[k] - c0[k]) / N for k in c0}
        table(["process", "CPU ms per job"], [[k, v] for k, v in per_cpu.items()] +
              [["all four", sum(per_cpu.values())], ["(wall ms per job)", 1e3 * wall / N],
               ["(e2e p50 ms)", latencies[N // 2]]])
        estimate.sort()
        health.sort()
        calls = {k: (v - k0.get(k, 0)) / N for k, v in k1.items() if k != "info" and v - k0.get(k, 0) > 0}
        print()
        table(["validation", "p50 ms"], [["POST /estimate (spec seen before)", estimate[N // 2]],
                                         ["GET /healthz", health[N // 2]],
                                         ["difference (goal <= 0.3)", estimate[N // 2] - health[N // 2]]])
        print()
        table(["Redis command", "per job"], [["all", sum(calls.values())]] +
              [[k, v] for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v >= 0.5])
    finally:
        stack.stop()
    footer(started)


if __name__ == "__main__":
    main()
