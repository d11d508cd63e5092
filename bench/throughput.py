"""Throughput of tiny jobs (the 6-8-3 tanh net, 83 parameters, numcheck off) with 1 and 2 workers, jobs/s.

A private stack (tests/support/stack.py) per row. "2 workers" runs with GRADSVC_WORKERS=2, as `gradsvc up`
starts them: each CPU worker then takes cores / 2 intra-op threads; the last row leaves
GRADSVC_WORKERS unset (each worker on all cores, as before that setting was honoured) to show why.
  queue -> result  the bench enqueues N jobs straight onto the RQ queue, as the API does
                   (service.enqueue.Enqueuer.enqueue), then blocks on each job's RQ results stream until
                   the last one has ended: N / (last end - first enqueue).
  via the API      C client threads, each POST /gradients?wait=30 one after another (sync wait):
                   N / wall time, HTTP, validation and the API's own Redis calls included.

`--combine` (or `--take`; the worker's take, GRADSVC_WORKER_TAKE, and its jobs computed together): the same tiny
job (numcheck off) via the API at 1, 8 and 32 clients (sync waits), 2 workers, with a take of 1 (each job dequeued
and computed alone) and of TAKE (taken together, and those of one structure computed as one batched computation:
gradsvc/engine/combine.py); the two stacks run alternately, ROUNDS times, so the machine's drift falls on both:
jobs/s, p50 and p99 (ms) and the share of answers computed together, per round, and TAKE's medians over take 1's.
Each client thread keeps one keep-alive http.client connection (bench/common.py concurrent_posts `light`): on 2
cores the load generator shares the machine it measures, and httpx's ~5 ms of CPU a request (`--httpx`, the
client of the earlier figures) took as much as the API and the workers together; both stacks get the same client.

`--against DIR`: the same three cells, 2 workers, take 1, for a stack run from this checkout and one run from
DIR's (another commit's checkout: `git worktree add DIR COMMIT`), alternately, ROUNDS times: the API's own
changes measured against the machine's drift. With `--combine` too, this checkout's stack takes TAKE and computes
together while DIR's takes 1, both with the keep-alive clients: all of this checkout's gains against DIR's.

Run: .venv/bin/python bench/throughput.py [--combine [--httpx] | --against DIR [--combine]]
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import msgspec
from common import (
    ROOT,
    Stack,
    concurrent_posts,
    footer,
    header,
    seed_a_body,
    start_stack,
    table,
)
from redis import Redis

from gradsvc.broker import keys
from gradsvc.runtime.settings import Settings
from service.app import job_parts
from tests.support import stack as stack_module

JOBS = 300
CLIENTS = 4
TAKE, ROUNDS, PER_CELL = 8, 2, 320


def queue_to_result(stack: Stack, body: bytes, n: int) -> float:
    store = job_parts(Settings(redis_url=stack.redis.url))
    r = Redis.from_url(stack.redis.url)
    try:
        t0 = time.perf_counter()
        ids = [store.enqueuer.enqueue(body, "json", "auto", "")[0] for _ in range(n)]
        for job_id in ids:
            got = r.xread({keys.rq_results_stream(job_id): "0-0"}, count=1, block=60_000)
            assert got, f"job {job_id} did not end in 60 s"
        return n / (time.perf_counter() - t0)
    finally:
        r.close()
        store.queues.redis.close()


def via_api(stack: Stack, body: bytes, n: int, clients: int) -> float:
    per = n // clients
    errors: list[str] = []

    def client():
        headers = {"Content-Type": "application/json", **stack.auth_headers()}
        with httpx.Client(base_url=stack.base_url, timeout=60, headers=headers) as c:
            for _ in range(per):
                r = c.post("/gradients", params={"wait": 30}, content=body)
                if r.status_code != 200:
                    errors.append(r.text[:200])

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    return per * clients / (time.perf_counter() - t0)


def main() -> list[list]:
    started = header("Throughput: tiny jobs, 1 and 2 workers", __doc__.split("Run:")[0])
    body = msgspec.json.encode(seed_a_body({"numcheck": "off"}))
    rows = []
    for label, workers, env in [("1", 1, {}), ("2", 2, {"GRADSVC_WORKERS": "2"}),
                                ("2, all cores each", 2, {"GRADSVC_WORKERS": "1"})]:
        stack = start_stack(workers=workers, **env)
        try:
            queue_to_result(stack, body, 40)  # warm-up
            q = queue_to_result(stack, body, JOBS)
            a = via_api(stack, body, JOBS, CLIENTS)
            rows.append([label, q, 1e3 / q, a, 1e3 / a])
        finally:
            stack.stop()
    for r in rows:
        r += [r[1] / rows[0][1], r[3] / rows[0][3]]
    table(["workers", "queue->result jobs/s", "ms/job", f"via API ({CLIENTS} clients) jobs/s", "ms/job",
           "queue x 1 worker", "API x 1 worker"], rows)
    print(f"\n{JOBS} jobs per cell; 2 workers share the machine's 2 cores with Redis, the API and this bench")
    footer(started)
    return rows


def take_mode(light: bool = True) -> list[list]:
    started = header(f"Throughput: tiny jobs via the API, alone (take 1) and taken and computed together (take {TAKE})",
                     __doc__.split("`--combine`")[1].split("Run:")[0])
    body = msgspec.json.encode(seed_a_body({"numcheck": "off"}))
    rows, loads = [], [_load()]
    cells: dict[tuple[int, int], list[dict]] = {}
    for rnd in range(ROUNDS):
        for take in (1, TAKE):
            stack = start_stack(workers=2, GRADSVC_WORKERS="2", GRADSVC_WORKER_TAKE=str(take))
            try:
                stack.wait_ready(2)
                concurrent_posts(stack.base_url, body, 8, 10, stack.auth_headers(), light)  # warm-up
                for clients in (1, 8, 32):
                    before = _cpu_s(stack)
                    got = concurrent_posts(stack.base_url, body, clients, max(1, PER_CELL // clients),
                                           stack.auth_headers(), light)
                    n = max(1, PER_CELL // clients) * clients
                    cpu = {k: 1e3 * (v - before[k]) / n for k, v in _cpu_s(stack).items()}
                    cells.setdefault((take, clients), []).append(got)
                    rows.append([rnd + 1, take, clients, got["rps"], got["p50"], got["p99"], got["combined"],
                                 cpu["api"], cpu["workers"], cpu["redis"], cpu["bench"]])
            finally:
                stack.stop()
            loads.append(_load())
    table(["round", "take", "clients", "jobs/s", "p50 ms", "p99 ms", "combined", "API cpu ms/job",
           "workers cpu ms/job", "Redis cpu ms/job", "bench cpu ms/job"], rows)
    ratios = [[c, _ratio(cells, c, "rps"), _ratio(cells, c, "p50"), _ratio(cells, c, "p99")] for c in (1, 8, 32)]
    print(f"\ntake {TAKE} over take 1, the rounds' medians:")
    table(["clients", "jobs/s", "p50", "p99"], ratios)
    print(f"\nclients: {'http.client' if light else 'httpx'}, one keep-alive connection per thread")
    print(f"\n{PER_CELL} jobs per cell; 2 workers share the 2 cores with Redis, the API and this bench; "
          f"load average (1 min) before and after each stack: {', '.join(loads)}")
    footer(started)
    return rows


def three_cells(body: bytes, light: bool = False, **env: str) -> list[list]:
    """jobs/s, p50 and p99 (ms) at 1, 8 and 32 clients on a fresh stack of 2 workers."""
    stack = start_stack(workers=2, GRADSVC_WORKERS="2", **env)
    try:
        stack.wait_ready(2)
        concurrent_posts(stack.base_url, body, 8, 10, stack.auth_headers(), light)  # warm-up
        out = []
        for clients in (1, 8, 32):
            got = concurrent_posts(stack.base_url, body, clients, max(1, PER_CELL // clients), stack.auth_headers(),
                                   light)
            out.append([clients, got["rps"], got["p50"], got["p99"], float(_load())])
        return out
    finally:
        stack.stop()


def against_mode(against: Path, combine: bool = False) -> list[list]:
    """`combine`: this checkout's stack takes TAKE and computes together, DIR's takes 1 (its default), both
    with the keep-alive http.client clients; else both take 1, with httpx clients (the first figures')."""
    started = header(f"Throughput: tiny jobs via the API, this checkout{f' (take {TAKE})' if combine else ''} "
                     f"against {against} (take 1)",
                     "`--against DIR`" + __doc__.split("`--against DIR`")[1].split("Run:")[0])
    body = msgspec.json.encode(seed_a_body({"numcheck": "off"}))
    rows = []
    for rnd in range(ROUNDS):
        for label, root in (("this", ROOT), ("against", against)):
            stack_module.ROOT = root  # the stack's processes run from that checkout
            env = {"GRADSVC_WORKER_TAKE": str(TAKE if combine and label == "this" else 1)}
            try:
                rows += [[rnd + 1, label, *cell] for cell in three_cells(body, light=combine, **env)]
            finally:
                stack_module.ROOT = ROOT
    table(["round", "checkout", "clients", "jobs/s", "p50 ms", "p99 ms", "load (1 min)"], rows)
    print(f"\n{PER_CELL} jobs per cell; 2 workers share the 2 cores with Redis, the API and this bench; "
          f"clients: {'http.client' if combine else 'httpx'}")
    footer(started)
    return rows


def _cpu_s(stack: Stack) -> dict[str, float]:
    """CPU seconds (user + system) so far of the API (with its children), the workers, Redis and this bench."""
    import psutil

    def tree(pids) -> float:
        total = 0.0
        for pid in pids:
            try:
                procs = [psutil.Process(pid)]
                procs += procs[0].children(recursive=True)
                total += sum(p.cpu_times().user + p.cpu_times().system for p in procs)
            except psutil.Error:
                pass
        return total

    me = psutil.Process().cpu_times()
    return {"api": tree([stack.api.pid]), "workers": tree([w.pid for w in stack.workers]),
            "redis": tree([stack.redis.proc.pid]), "bench": me.user + me.system}


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def _ratio(cells: dict, clients: int, key: str) -> float:
    import statistics

    return statistics.median(g[key] for g in cells[(TAKE, clients)]) / \
        statistics.median(g[key] for g in cells[(1, clients)])


if __name__ == "__main__":
    if "--against" in sys.argv:
        against_mode(Path(sys.argv[sys.argv.index("--against") + 1]).resolve(), "--combine" in sys.argv)
    elif "--take" in sys.argv or "--combine" in sys.argv:
        take_mode(light="--httpx" not in sys.argv)
    else:
        main()
