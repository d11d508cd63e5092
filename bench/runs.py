"""Training runs: what recording a step costs a small job, and how fast a 100-step run is served.

A private stack (tests/support/stack.py: redis-server, the API, one worker) on loopback; one httpx client with
keep-alive. The small job is the 6-8-3 tanh float64 net (83 parameters, batch 4) with its weights in the body
(as a training loop sends them, so each step keeps them and computes update ratios), numcheck off.
  without run   POST /gradients?wait=30, client wall time to the parsed 200 answer
  with run      the same body with "run": {"name", "step"}, interleaved with the above, so load from other
                processes shifts both alike (the goal: p50 within 0.3 ms of the plain job's)
  worker side   in this process, against the stack's Redis: what a step adds to the worker's job (the read
                of the previous weights in flight during the computation, the norms and ratios, the record script
                in the success transaction), as the difference from the same job and transaction without it,
                interleaved; with the worker's own copy of the previous weights, and after another worker's step
  best window   the lowest mean over 5 consecutive interleaved rounds, each kind's: on a machine shared with
                other work, what the rounds that ran undisturbed took (the difference of the two kinds' best windows
                moves far less with the load than the medians do)
  page, CSV     a 100-step run's /ui/runs/{name} page and GET /runs/{name}?format=csv (and its JSON), client
                wall time per request (the goal: under 50 ms each)

Run: .venv/bin/python bench/runs.py
"""

from __future__ import annotations

import copy
import statistics
import time

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import msgspec
import redis
import torch

from common import footer, header, median, percentile, seed_a_body, start_stack, table, verdict
from gradsvc.broker.runs import RunBounds
from gradsvc.engine import Engine, EngineConfig
from gradsvc.wire import GradientRequest
from tests.support.nets import seed_a_module
from workers.run_steps import StepRecorder, weights_cache

REQUESTS = 300
WARMUP = 30
PAGE_STEPS = 100
READS = 50
WINDOW = 5  # consecutive interleaved rounds whose mean is one window (best_window)


def step_body() -> dict:
    body = seed_a_body({"numcheck": "off"})
    body["model"]["weights"] = {n: {"dtype": "float64", "shape": list(t.shape), "data": t.tolist()}
                                for n, t in seed_a_module().state_dict().items()}
    return body


def post_ms(client: httpx.Client, content: bytes) -> float:
    t0 = time.perf_counter()
    r = client.post("/gradients", params={"wait": 30}, content=content, headers={"Content-Type": "application/json"})
    r.json()
    assert r.status_code == 200, r.text
    return 1e3 * (time.perf_counter() - t0)


def best_window(xs: list[float]) -> float:
    """The lowest mean over WINDOW consecutive rounds: on a machine shared with other work, the rounds that ran
    undisturbed (every kind interleaved in each round, so each kind's best window is as quiet as the others')."""
    return min(statistics.fmean(xs[i:i + WINDOW]) for i in range(0, len(xs) - WINDOW + 1, WINDOW))


def recording_cost(client: httpx.Client) -> list[list]:
    plain = step_body()
    with_run = copy.deepcopy(plain)
    times: dict[str, list[float]] = {"plain": [], "run": []}
    for i in range(WARMUP + REQUESTS):
        with_run["run"] = {"name": "bench-steps", "step": i}
        a = post_ms(client, msgspec.json.encode(plain))
        b = post_ms(client, msgspec.json.encode(with_run))
        if i >= WARMUP:
            times["plain"].append(a)
            times["run"].append(b)
    pairs = [b - a for a, b in zip(times["plain"], times["run"])]
    return [["without run", median(times["plain"]), percentile(times["plain"], 99), "", best_window(times["plain"])],
            ["with run", median(times["run"]), percentile(times["run"], 99), median(pairs), best_window(times["run"])]]


def worker_side(redis_url: str) -> list[list]:
    """Microseconds a step adds to the worker's job, measured in this process as the worker runs it: the small
    job's computation and its success transaction, without a step, with one recorded by a worker that recorded
    the previous step too (its own copy of the weights), and with one after another worker's step (the Redis
    copy: two workers' copies, alternating), interleaved."""
    requests = {kind: msgspec.json.decode(msgspec.json.encode({**step_body(), "run": {"name": f"bench-{kind}"}}),
                                          type=GradientRequest) for kind in ("plain", "one", "two")}
    engine, cpu = Engine(EngineConfig()), torch.device("cpu")
    client = redis.Redis.from_url(redis_url)
    one, two = [weights_cache()], [weights_cache(), weights_cache()]
    times: dict[str, list[float]] = {"plain": [], "one": [], "two": []}
    for i in range(WARMUP + REQUESTS):
        for kind, caches in (("plain", None), ("one", one), ("two", two)):
            t0 = time.perf_counter()
            recorder = None if caches is None else StepRecorder(client, "bench", RunBounds(), "owner",
                                                                f"{kind}-{i}", requests[kind], caches[i % len(caches)])
            result = engine.compute(requests[kind], device=cpu)
            write = None if recorder is None else recorder.finish(result)
            with client.pipeline() as pipe:
                pipe.set("bench:result", b"x", ex=60)
                if write is not None:
                    write(pipe)
                pipe.execute()
            if i >= WARMUP:
                times[kind].append(1e6 * (time.perf_counter() - t0))
    client.close()
    plain = times["plain"]
    return [["job and its success transaction", median(plain), percentile(plain, 99), "", best_window(plain)]] + [
        [label, median(times[kind]), percentile(times[kind], 99), median([b - a for a, b in zip(plain, times[kind])]),
         best_window(times[kind])]
        for kind, label in (("one", "with the step, the worker's own copy"),
                            ("two", "with the step after another worker's"))]


def read_ms(client: httpx.Client, path: str, params: dict | None = None) -> list[float]:
    out = []
    for _ in range(READS):
        t0 = time.perf_counter()
        r = client.get(path, params=params)
        assert r.status_code == 200, r.text[:300]
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def serving(client: httpx.Client) -> list[list]:
    body = step_body()
    for i in range(PAGE_STEPS):
        body["run"] = {"name": "bench-page", "step": i}
        post_ms(client, msgspec.json.encode(body))
    rows = []
    for name, path, params in [("run page /ui/runs/{name}", "/ui/runs/bench-page", None),
                               ("GET /runs/{name}?format=csv", "/runs/bench-page", {"format": "csv"}),
                               ("GET /runs/{name} (JSON)", "/runs/bench-page", None)]:
        ms = read_ms(client, path, params)
        rows.append([name, median(ms), percentile(ms, 99)])
    return rows


def main() -> list[list]:
    started = header("Training runs: a step's recording cost; a 100-step run's page and CSV", __doc__.split("Run:")[0])
    stack = start_stack(workers=1)
    try:
        with httpx.Client(base_url=stack.base_url, timeout=60, headers=stack.auth_headers()) as client:
            cost = recording_cost(client)
            served = serving(client)
        worker = worker_side(stack.redis.url)
    finally:
        stack.stop()
    table(["small job", "p50 ms", "p99 ms", "median of pairs (run - plain) ms", "best window ms"], cost)
    extra = cost[1][1] - cost[0][1]
    print(f"\ngoal: p50 with run within 0.3 ms of without: {extra:+.3f} ms ({verdict(extra, 0.3)}); "
          f"{REQUESTS} pairs after {WARMUP} warm-up; best windows of {WINDOW} rounds: {cost[1][4] - cost[0][4]:+.3f} ms")
    table(["worker side", "p50 us", "p99 us", "median of pairs us", "best window us"], worker)
    print(f"\nthe step's own cost in the worker: {worker[1][3]:.0f} us (median of pairs; {worker[2][3]:.0f} us after "
          f"another worker's step); best windows: {worker[1][4] - worker[0][4]:+.0f} us, "
          f"{worker[2][4] - worker[0][4]:+.0f} us")
    table([f"{PAGE_STEPS}-step run", "p50 ms", "p99 ms"], served)
    worst = max(row[1] for row in served[:2])
    print(f"\ngoal: page and CSV p50 under 50 ms: worst {worst:.2f} ms ({verdict(worst, 50.0)}); {READS} reads each")
    footer(started)
    return cost + worker + served


if __name__ == "__main__":
    main()
