"""Sharding: one compute-bound job split across two workers (`options.shards: 2`) against the same job
on one worker (`shards: 1`), end to end, on the same stack.

8 x (Linear(1024, 1024) + ReLU), batch 4096, float32, MSE, numcheck off, MessagePack both ways (16 MB
of inputs, 16 MB of targets, 33.6 MB of gradients). A private stack (tests/support/stack.py) with two workers
and GRADSVC_WORKERS=2, as `gradsvc up --workers 2` starts them: each CPU worker takes cores / 2
intra-op threads, so one worker alone uses half the machine. Rounds interleave the two requests so
that load from other processes hits both alike; each row is the median, the ratio the median of
per-round ratios.
  e2e            client wall time: POST /gradients?wait=300 until the answer is read.
  critical path  the sharded result's timings.total_ms: the slowest shard's compute + the reduction.
  compute        the sharded result's shards.compute_ms: every shard's compute, summed.

Run: .venv/bin/python bench/sharding.py
"""

from __future__ import annotations

import time

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import msgspec
import torch

from common import footer, header, median, raw_tensor, start_stack, table, verdict, wide_stack_layers

DEPTH, WIDTH, BATCH = 8, 1024, 4096
ROUNDS = 5
GOAL = 1.6


def body(shards: int) -> bytes:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, WIDTH, generator=g)
    return msgspec.msgpack.encode(
        {"model": {"layers": wide_stack_layers(DEPTH, WIDTH), "dtype": "float32", "seed": 0},
         "inputs": raw_tensor(x), "targets": raw_tensor(y), "loss": "mse",
         "options": {"numcheck": "off", "shards": shards}})


def main() -> list[list]:
    started = header("Sharding: 8 x Linear(1024,1024)+ReLU, batch 4096, float32, shards 2 vs 1 on two workers",
                     __doc__.split("Run:")[0])
    bodies = {1: body(1), 2: body(2)}
    stack = start_stack(workers=2, GRADSVC_WORKERS="2")
    m: dict[str, list[float]] = {k: [] for k in ("e2e1", "e2e2", "worker1", "critical2", "compute2", "reduce2")}
    try:
        headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack", **stack.auth_headers()}
        with httpx.Client(base_url=stack.base_url, timeout=600, headers=headers) as client:
            for i in range(ROUNDS + 1):  # the first round warms both workers up
                for shards in (1, 2):
                    t0 = time.perf_counter()
                    r = client.post("/gradients", params={"wait": 300}, content=bodies[shards])
                    elapsed = 1e3 * (time.perf_counter() - t0)
                    assert r.status_code == 200, r.content[:300]
                    answer = msgspec.msgpack.decode(r.content)
                    if i == 0:
                        continue
                    m[f"e2e{shards}"].append(elapsed)
                    if shards == 1:
                        m["worker1"].append(answer["timings"]["total_ms"])
                    else:
                        info = answer["shards"]
                        assert info["count"] == 2, info
                        m["critical2"].append(info["critical_path_ms"])
                        m["compute2"].append(info["compute_ms"])
                        m["reduce2"].append(info["reduce_ms"])
    finally:
        stack.stop()
    ratio = median([a / b for a, b in zip(m["e2e1"], m["e2e2"])])
    rows = [["shards: 1, end to end", median(m["e2e1"]), 1.0],
            ["shards: 2, end to end", median(m["e2e2"]), ratio],
            ["shards: 1, worker compute (timings.total_ms)", median(m["worker1"]), ""],
            ["shards: 2, critical path (slowest shard + reduce)", median(m["critical2"]), ""],
            ["shards: 2, summed compute of both shards", median(m["compute2"]), ""],
            ["shards: 2, the reduction alone", median(m["reduce2"]), ""]]
    table(["what", "median ms", "speed-up (shards 1 / shards 2, median of rounds)"], rows)
    print(f"\ngoal shards: 2 at least {GOAL}x faster end to end than shards: 1: {ratio:.2f}x "
          f"({verdict(ratio, GOAL, at_most=False)}); {ROUNDS} rounds after 1 warm-up")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
