"""Engine overhead: gradsvc.engine.compute() against a plain PyTorch loop on the same model and batch.

Compared, per model, in interleaved rounds (each ratio is the median of per-round ratios, so load
from other processes hits both sides of a ratio alike):
  fresh   plain PyTorch doing the same work as one engine pass: a model just built
          (torch.manual_seed + nn.Sequential, not timed), then its first step, timed:
          out = model(x); loss = F.cross_entropy(out, y); torch.autograd.grad(loss, params).
  warm    the same step in a warm loop (model built once, stepped again and again): the floor.
  phases  the engine's own timed phases, timings.forward_ms + timings.backward_ms of one compute()
          call (timing_repeat=1, numcheck off; the engine builds a fresh model per call). The goal
          ("at most 1.10x plain PyTorch with memory accounting off, 1.25x on") is read on
          phases/fresh, the same work on both sides; phases/warm shows what a first pass costs
          over a warm loop. With memory on, the accounting hooks run inside these phases.
  call    the whole compute() wall time (decode, validate, build + seeded init, forward, backward,
          memory report, gradients encoded to bytes), over plain build + first step.

Run: .venv/bin/python bench/engine_overhead.py
"""

from __future__ import annotations

import time

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from common import footer, header, median, raw_tensor, table, verdict, wide_stack_layers
from gradsvc.engine import Engine, EngineConfig
from gradsvc.wire import GradientRequest

CPU = torch.device("cpu")


def cnn_small() -> list[dict]:
    return [{"type": "Conv2d", "in_channels": 1, "out_channels": 8, "kernel_size": 3, "padding": 1}, {"type": "ReLU"},
            {"type": "MaxPool2d", "kernel_size": 2},
            {"type": "Conv2d", "in_channels": 8, "out_channels": 16, "kernel_size": 3, "padding": 1}, {"type": "ReLU"},
            {"type": "MaxPool2d", "kernel_size": 2}, {"type": "Flatten"},
            {"type": "Linear", "in_features": 16 * 7 * 7, "out_features": 10}]


def cnn_medium() -> list[dict]:
    return [{"type": "Conv2d", "in_channels": 3, "out_channels": 32, "kernel_size": 3, "padding": 1}, {"type": "ReLU"},
            {"type": "Conv2d", "in_channels": 32, "out_channels": 32, "kernel_size": 3, "padding": 1}, {"type": "ReLU"},
            {"type": "MaxPool2d", "kernel_size": 2},
            {"type": "Conv2d", "in_channels": 32, "out_channels": 64, "kernel_size": 3, "padding": 1}, {"type": "ReLU"},
            {"type": "MaxPool2d", "kernel_size": 2}, {"type": "Flatten"},
            {"type": "Linear", "in_features": 64 * 8 * 8, "out_features": 10}]


# name, layers, input shape, classes (cross-entropy targets), rounds
CASES = [
    ("MLP 784-128-10, b64", [{"type": "Linear", "in_features": 784, "out_features": 128}, {"type": "ReLU"},
                             {"type": "Linear", "in_features": 128, "out_features": 10}], (64, 784), 10, 60),
    ("MLP 4x512, b128", wide_stack_layers(4, 512), (128, 512), 512, 40),
    ("MLP 8x1024, b256", wide_stack_layers(8, 1024), (256, 1024), 1024, 8),
    ("CNN 2 conv 28x28, b32", cnn_small(), (32, 1, 28, 28), 10, 40),
    ("CNN 3 conv 32x32, b64", cnn_medium(), (64, 3, 32, 32), 10, 8),
]


def plain_model(layers: list[dict], seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(getattr(nn, d["type"])(**{k: v for k, v in d.items() if k != "type"}) for d in layers))


def request(layers, x, y, memory: bool) -> GradientRequest:
    body = {"model": {"layers": layers, "dtype": "float32", "seed": 0}, "inputs": raw_tensor(x),
            "targets": raw_tensor(y), "loss": "cross_entropy",
            "options": {"numcheck": "off", "memory": memory, "timing_repeat": 1}}
    # Through MessagePack, as the worker receives it: tensors arrive as raw bytes.
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def run_case(name, layers, shape, classes, rounds):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, classes, (shape[0],), generator=g)
    model = plain_model(layers)
    params = list(model.parameters())
    worker_engine = Engine(EngineConfig())  # as a worker holds one: its caches across calls
    reqs = {m: request(layers, x, y, m) for m in (False, True)}

    def plain_step(m=model, ps=params) -> float:
        t0 = time.perf_counter()
        loss = F.cross_entropy(m(x), y)
        torch.autograd.grad(loss, ps)
        return time.perf_counter() - t0

    def plain_fresh() -> tuple[float, float]:
        t0 = time.perf_counter()
        m = plain_model(layers)
        build = time.perf_counter() - t0
        return build, plain_step(m, list(m.parameters()))

    def engine(memory: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        r = worker_engine.compute(reqs[memory], device=CPU)
        wall = time.perf_counter() - t0
        return (r.timings.forward_ms + r.timings.backward_ms) / 1e3, wall

    for _ in range(3):  # warm-up: allocator, BLAS workspaces, first-call dispatch
        plain_step(), engine(False), engine(True)
    plain, build, fresh, off, on, off_call, on_call = [], [], [], [], [], [], []
    for _ in range(rounds):
        plain.append(plain_step())
        b, f = plain_fresh()
        build.append(b), fresh.append(f)
        p, w = engine(False)
        off.append(p), off_call.append(w)
        p, w = engine(True)
        on.append(p), on_call.append(w)
    base = [b + f for b, f in zip(build, fresh)]
    ratio = lambda a, b: median([x / y for x, y in zip(a, b)])  # noqa: E731
    return {"warm": median(plain), "fresh": median(fresh), "off": median(off), "off_call": median(off_call),
            "off/fresh": ratio(off, fresh), "on/fresh": ratio(on, fresh), "off/warm": ratio(off, plain),
            "on/warm": ratio(on, plain), "call_off": ratio(off_call, base), "call_on": ratio(on_call, base)}


def main() -> list[list]:
    started = header("Engine overhead: compute() vs plain PyTorch (CPU, float32, cross-entropy, numcheck off)",
                     __doc__.split("Run:")[0])
    rows = []
    worst_off = worst_on = 0.0
    for name, layers, shape, classes, rounds in CASES:
        m = run_case(name, layers, shape, classes, rounds)
        r_off, r_on = m["off/fresh"], m["on/fresh"]
        worst_off, worst_on = max(worst_off, r_off), max(worst_on, r_on)
        rows.append([name, 1e3 * m["warm"], 1e3 * m["fresh"], 1e3 * m["off"], r_off, r_on, m["off/warm"],
                     m["on/warm"], 1e3 * m["off_call"], m["call_off"], m["call_on"]])
    table(["model", "warm ms", "fresh ms", "phases ms (mem off)", "phases/fresh off", "phases/fresh on",
           "phases/warm off", "phases/warm on", "call ms (mem off)", "call/(build+fresh) off",
           "call/(build+fresh) on"], rows)
    print(f"\ngoal phases/fresh, memory off <= 1.10: worst {worst_off:.2f} ({verdict(worst_off, 1.10)}); "
          f"memory on <= 1.25: worst {worst_on:.2f} ({verdict(worst_on, 1.25)})")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
