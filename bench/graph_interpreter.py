"""Graph interpreter overhead: a GraphModel (gradsvc/engine/graph/interpreter.py) against torch.export's own
`ep.module()` and the eager module, forward + backward on the same weights and batch.

Per model, interleaved rounds; each side's time in a round is the fastest of 3 calls, and each
ratio is the median of per-round ratios (load from other processes hits both sides alike). One
torch thread, so that the ratio reads the interpreter, not thread scheduling on a shared machine. The goal (engine overhead <= 1.10x in-process
`ep.module()` for a small transformer) is read on graph/ep.module. Also timed: validating a
graph (compile_graph: schema checks of every node), the meta-device shape check, the batch-mixing
scan, and refusing a 100,000-node graph (decode from JSON + validate).

Run: .venv/bin/python bench/graph_interpreter.py
"""

from __future__ import annotations

import copy
import time

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import torch
from torch import nn

from common import footer, header, median, table, verdict
from gradclient.export import export_graph
from gradsvc import wire
from gradsvc.engine import SpecError
from gradsvc.engine.graph.batch_flow import batch_mixing_nodes
from gradsvc.engine.graph.compiler import build_graph, compile_graph
from gradsvc.engine.graph.interpreter import load_weights
from gradsvc.engine.graph.meta_check import validate_graph_shapes
from gradsvc.engine.spec import Limits

LIMITS = Limits()


def cases():
    from tests.support import models

    torch.manual_seed(0)
    yield "small transformer d64 L2, b8 s32", models.SmallTransformer().train(), torch.randint(0, 100, (8, 32)), 20
    yield "tiny pre-norm block, b8", models.PreNormBlock().train(), torch.randn(8, 5, 8), 30
    yield "ResNet block (BN train), b16", models.ResNetBlock(16).train(), torch.randn(16, 16, 16, 16), 20
    try:
        llama = models.TinyLlama(vocab=50, hidden=16, layers=2).train()
        yield "HF Llama tiny, b4 s7", llama, torch.randint(0, 50, (4, 7)), 20
    except ImportError:
        pass


def step(model: nn.Module, x: torch.Tensor, params: list) -> None:
    out = model(x)
    out = out if isinstance(out, torch.Tensor) else out.to_tuple()[0] if hasattr(out, "to_tuple") else out[0]
    torch.autograd.grad(out.float().square().mean(), params)


def per_call(fn, n: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    torch.set_num_threads(1)
    started = header("Graph interpreter overhead", __doc__.split("Run:")[0])
    rows = []
    for name, model, x, rounds in cases():
        eg = export_graph(model, (x,))
        ep = torch.export.export(model, (x,))
        epm = ep.module()
        graph = load_weights(build_graph(eg.graph, limits=LIMITS, device="meta"),
                             {k: v.clone() for k, v in eg.weights.items()}, device="cpu")
        eager = copy.deepcopy(model)
        sides = {"eager": eager, "ep.module": epm, "graph": graph}
        params = {k: [p for p in m.parameters() if p.requires_grad] for k, m in sides.items()}
        for k, m in sides.items():  # warm up
            step(m, x, params[k])
        ratios_ep, ratios_eager, ms = [], [], []
        for _ in range(rounds):
            t = {k: min(per_call(lambda m=m, k=k: step(m, x, params[k])) for _ in range(3))
                 for k, m in sides.items()}
            ratios_ep.append(t["graph"] / t["ep.module"])
            ratios_eager.append(t["graph"] / t["eager"])
            ms.append(t["graph"] * 1e3)
        validate_ms = per_call(lambda: compile_graph(eg.graph, limits=LIMITS), 5) * 1e3
        meta = build_graph(eg.graph, limits=LIMITS, device="meta")
        meta_ms = per_call(lambda: validate_graph_shapes(meta, x.to("meta"), limits=LIMITS), 5) * 1e3
        mix_ms = per_call(lambda: batch_mixing_nodes(meta, list(x.shape)), 3) * 1e3
        rows.append([name, len(eg.graph.nodes), median(ms), median(ratios_ep), median(ratios_eager), validate_ms,
                     meta_ms, mix_ms])
    table(["model", "nodes", "graph fwd+bwd ms", "graph/ep.module", "graph/eager", "validate ms", "meta check ms",
           "mixing scan ms"], rows)
    worst = max(r[3] for r in rows[:1])
    print(f"\nsmall transformer graph/ep.module = {worst:.3f} (goal <= 1.10x: {verdict(worst, 1.10)})")

    nodes = [{"name": f"n{i}", "op": "aten.relu.default", "args": [{"node": f"n{i - 1}" if i else "x"}]}
             for i in range(100_000)]
    body = msgspec.json.encode({"inputs": [{"name": "x", "kind": "input"}], "nodes": nodes,
                                "outputs": [{"node": "n99999"}]})
    t0 = time.perf_counter()
    spec = msgspec.json.decode(body, type=wire.GraphSpec)
    decoded = time.perf_counter()
    try:
        compile_graph(spec, limits=LIMITS)
    except SpecError as exc:
        assert exc.code == "too_large"
    done = time.perf_counter()
    print(f"100,000-node graph ({len(body) / 1e6:.1f} MB JSON): decoded in {1e3 * (decoded - t0):.1f} ms, refused "
          f"in {1e3 * (done - decoded):.3f} ms after that")
    footer(started)


if __name__ == "__main__":
    main()
