"""Graph models through the engine: compute() on an exported small transformer against in-process
`torch.export` `ep.module()` forward + backward, and what step two of a training loop costs the API.

Compared in interleaved rounds (each ratio is the median of per-round ratios, so load from other
processes hits both sides alike):
  ep.module  the same exported program run by torch itself: out = ep.module()(x);
             loss = F.cross_entropy(out, y); torch.autograd.grad(loss, params), in a warm loop.
  phases     the engine's own timed phases, timings.forward_ms + timings.backward_ms of one compute()
             call (numcheck off, memory off, timing_repeat=3: the median pass), against the median of
             3 ep.module steps: the graph interpreter, micro-batching and timing pieces.
             The goal (<= 1.10x in-process ep.module()) is read on phases/ep.module.
  call       the whole compute() wall time (decode, graph look-up, weights checked and loaded,
             forward, backward, gradients encoded), over ep.module's step.
Then the API's side of step two, prepare() on the meta device as POST /gradients runs it: the graph
sent whole the first time (validated, shape-checked), the same graph sent again (hashed, then found),
and model.graph_ref (found by its hash: no hashing, no validation); and the request bytes of step one
(graph + weights + batch) against step two (graph_ref + weights + batch).

Run: .venv/bin/python bench/graph_overhead.py
"""

from __future__ import annotations

import importlib
import time

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from common import footer, header, median, raw_tensor, table, verdict
from gradclient.export import export_graph
from gradsvc.engine import Engine, EngineConfig
from gradsvc.engine.prepared import Batch
from gradsvc.wire import GradientRequest

prepare_graph = importlib.import_module("gradsvc.engine.prepare_graph")  # its private steps, timed alone

CONFIG = EngineConfig()
ENGINE = Engine(CONFIG)  # the API's, with its caches
torch.set_num_threads(1)  # on a shared machine, OpenMP threads waiting on busy cores swamp the ratio
REPEAT = 3


def body(graph_or_ref, weights: dict, x: torch.Tensor, y: torch.Tensor, **options) -> bytes:
    key = "graph_ref" if isinstance(graph_or_ref, str) else "graph"
    return msgspec.msgpack.encode({
        "model": {key: graph_or_ref, "weights": {k: raw_tensor(v) for k, v in weights.items()}},
        "inputs": raw_tensor(x), "targets": raw_tensor(y), "loss": "cross_entropy",
        "options": {"numcheck": "off", "memory": False, **options}})


def decode(raw: bytes) -> GradientRequest:
    return msgspec.msgpack.decode(raw, type=GradientRequest)


def ep_step(module: nn.Module, params: list, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    torch.autograd.grad(F.cross_entropy(module(x), y), params)
    return time.perf_counter() - t0


def clear_graph_caches() -> None:
    for cache in (ENGINE.caches.graph_templates, ENGINE.caches.graph_shapes, ENGINE.caches.batch_flows):
        cache.clear()


def per_call_ms(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e3 * (time.perf_counter() - t0) / n


def main() -> None:
    started = header("Graph models: engine path against ep.module(); step two at the API", __doc__.split("Run:")[0])
    torch.manual_seed(0)
    from tests.support.models import SmallTransformer

    model = SmallTransformer(classes=10).train()
    x, y = torch.randint(0, 100, (16, 32)), torch.randint(0, 10, (16,))
    exported = export_graph(model, (x,))
    epm = torch.export.export(model, (x,)).module()
    ep_params = [p for p in epm.parameters() if p.requires_grad]
    first = body(exported.graph, exported.weights, x, y)
    timed = body(exported.graph, exported.weights, x, y, timing_repeat=REPEAT)
    ep_step(epm, ep_params, x, y)
    ENGINE.compute(decode(first))  # warm: the validated graph is cached from here on

    phases, calls, steps = [], [], []
    for _ in range(8):
        # Each side's median of REPEAT steps (compute's timings are the median of its timed repeats).
        step_s = median([ep_step(epm, ep_params, x, y) for _ in range(REPEAT)])
        result = ENGINE.compute(decode(timed))
        phase_s = (result.timings.forward_ms + result.timings.backward_ms) / 1e3
        t0 = time.perf_counter()
        ENGINE.compute(decode(first))
        call_s = time.perf_counter() - t0
        phases.append(phase_s / step_s)
        calls.append(call_s / step_s)
        steps.append(step_s)
    table(["ep.module fwd+bwd ms", "phases / ep.module", "call / ep.module"],
          [[1e3 * median(steps), median(phases), median(calls)]])
    ratio = median(phases)
    print(f"\nsmall transformer ({len(exported.graph.nodes)} nodes, {sum(p.numel() for p in model.parameters())} "
          f"parameters, batch 16 x 32 tokens): phases/ep.module = {ratio:.3f} (goal <= 1.10x: {verdict(ratio, 1.10)})")

    ref = result.graph_ref
    second = body(ref, exported.weights, x, y)
    reqs = {"graph, first time": decode(first), "graph, seen before": decode(first), "graph_ref": decode(second)}
    rows = []
    clear_graph_caches()
    t0 = time.perf_counter()
    ENGINE.prepare(reqs["graph, first time"], "meta")
    rows.append(["graph, first time (validate + meta shape check)", 1e3 * (time.perf_counter() - t0)])
    rows.append(["graph, seen before (hash + look-up)",
                 per_call_ms(lambda: ENGINE.prepare(reqs["graph, seen before"], "meta"), 50)])
    graphs = {ref: exported.graph}.get  # the API's GraphStore hit: its LRU (the Redis EXPIRE aside)
    rows.append(["graph_ref (look-up)", per_call_ms(lambda: ENGINE.prepare(reqs["graph_ref"], "meta", graphs=graphs),
                                                200)])
    nodes_only = decode(msgspec.msgpack.encode({"model": {"graph_ref": ref, "weights": {}}, "inputs": [[0]],
                                                "targets": [0]}))
    caches = ENGINE.caches
    template = prepare_graph._graph_template(caches, ref, exported.graph, torch.float32, CONFIG)
    rows.append(["  of which the graph part (resolve + template + shape cache)",
                 per_call_ms(lambda: (prepare_graph._graph_spec(caches, nodes_only, torch.float32, graphs),
                                      prepare_graph._graph_template(caches, ref, exported.graph, torch.float32, CONFIG),
                                      prepare_graph._graph_output(caches, template, torch.float32, Batch.of(x), CONFIG.limits)),
                             2000)])
    table(["API prepare() on meta", "ms"], rows)
    graph_bytes = len(msgspec.msgpack.encode(exported.graph))
    print(f"\nrequest bytes: step one {len(first)} (graph {graph_bytes}), step two {len(second)} "
          f"({len(second) / len(first):.3f}x; the weights and the batch)")
    footer(started)


if __name__ == "__main__":
    main()
