"""Medium job end to end: 8 x (Linear(1024, 1024) + ReLU), batch 256, float32, MSE, numcheck off,
sent and answered in MessagePack (raw tensor bytes both ways; 8.4 M parameters, 33.6 MB of gradients).

A private stack (tests/support/stack.py) on loopback; one httpx client. Each round runs, one after another,
a plain step, compute() in process and the request, so load from other processes hits all three.
  e2e        client wall time: POST /gradients?wait=120 (MessagePack body, Accept MessagePack) until
             the answer is decoded into torch tensors (torch.frombuffer over the received bytes).
  plain f+b  plain PyTorch in this process, model already built, median warm step:
             model(x) -> F.mse_loss -> torch.autograd.grad: the goal's "in-process forward+backward".
  compute()  the engine in this process on the same request: the whole call (decode, build + init,
             forward, backward, memory accounting, gradients to bytes).
  worker     the worker's own timings.total_ms (compute() inside the worker) as answered.

Run: .venv/bin/python bench/medium_job.py
"""

from __future__ import annotations

import time

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from common import footer, header, median, raw_tensor, start_stack, table, verdict, wide_stack_layers
from gradsvc.engine import Engine, EngineConfig
from gradsvc.wire import GradientRequest

DEPTH, WIDTH, BATCH = 8, 1024, 256
REQUESTS = 8


def body() -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, WIDTH, generator=g)
    return {"model": {"layers": wide_stack_layers(DEPTH, WIDTH), "dtype": "float32", "seed": 0},
            "inputs": raw_tensor(x), "targets": raw_tensor(y), "loss": "mse", "options": {"numcheck": "off"}}


def plain_step(b: dict):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
    params = list(model.parameters())
    x = torch.frombuffer(bytearray(b["inputs"]["data"]), dtype=torch.float32).reshape(BATCH, WIDTH)
    y = torch.frombuffer(bytearray(b["targets"]["data"]), dtype=torch.float32).reshape(BATCH, WIDTH)

    def step() -> float:
        t0 = time.perf_counter()
        torch.autograd.grad(F.mse_loss(model(x), y), params)
        return 1e3 * (time.perf_counter() - t0)

    return step


def decode_answer(raw: bytes) -> dict[str, torch.Tensor]:
    answer = msgspec.msgpack.decode(raw)
    return {name: torch.frombuffer(t["data"], dtype=torch.float32).reshape(t["shape"])
            for name, t in answer["gradients"].items()}, answer


def main() -> list[list]:
    started = header("Medium job: 8 x Linear(1024,1024)+ReLU, batch 256, MessagePack both ways",
                     __doc__.split("Run:")[0])
    b = body()
    content = msgspec.msgpack.encode(b)
    req = msgspec.msgpack.decode(content, type=GradientRequest)
    engine, cpu = Engine(EngineConfig()), torch.device("cpu")
    step = plain_step(b)
    stack = start_stack(workers=1)
    m: dict[str, list[float]] = {k: [] for k in ("plain", "phases", "call", "e2e", "worker")}
    size = 0
    try:
        headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack",
                   **stack.auth_headers()}
        with httpx.Client(base_url=stack.base_url, timeout=300, headers=headers) as client:
            for i in range(REQUESTS + 2):  # interleaved rounds: plain step, compute() in process, the request
                plain = step()
                t0 = time.perf_counter()
                local = engine.compute(req, device=cpu)
                t1 = time.perf_counter()
                r = client.post("/gradients", params={"wait": 120}, content=content)
                grads, answer = decode_answer(r.content)
                t2 = time.perf_counter()
                assert r.status_code == 200 and len(grads) == 2 * DEPTH, r.content[:300]
                size = len(r.content)
                if i >= 2:
                    m["plain"].append(plain)
                    m["phases"].append(local.timings.forward_ms + local.timings.backward_ms)
                    m["call"].append(1e3 * (t1 - t0))
                    m["e2e"].append(1e3 * (t2 - t1))
                    m["worker"].append(answer["timings"]["total_ms"])
    finally:
        stack.stop()
    e2e, worker, call, phases = m["e2e"], m["worker"], median(m["call"]), median(m["phases"])
    plain = median(m["plain"])

    def ratio(key: str) -> float:  # median of per-round ratios to that round's plain step
        return median([x / p for x, p in zip(m[key], m["plain"])])

    p50 = median(e2e)
    rows = [["plain PyTorch forward+backward (warm)", plain, 1.0],
            ["engine phases in process (forward_ms + backward_ms)", phases, ratio("phases")],
            ["engine compute() in process (whole call)", call, ratio("call")],
            ["worker compute() (timings.total_ms)", median(worker), ratio("worker")],
            ["end to end, MessagePack", p50, ratio("e2e")]]
    table(["what", "median ms", "/ plain forward+backward (median of rounds)"], rows)
    print(f"\nrequest {len(content) / 1e6:.1f} MB, answer {size / 1e6:.1f} MB; e2e / compute() in process "
          f"{p50 / call:.2f}; e2e - worker compute {p50 - median(worker):.1f} ms")
    goal = ratio("e2e")
    print(f"goal e2e / in-process forward+backward <= 1.3: {goal:.2f} ({verdict(goal, 1.3)}); "
          f"{REQUESTS} requests after 2 warm-up")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
