"""What the API pays to validate a new graph (gradsvc/engine/prepare.py: compile, then the meta-device shape
check, run with grad on), per node, by op: chains of N nodes of one op after a linear, through prepare() on
meta, one torch thread, as the API runs it. GRADSVC_MAX_GRAPH_NODES (default 5,000) bounds the worst of
these; a 20,000-node graph cost 1.5-12 s here without that bound.

Run: .venv/bin/python bench/graph_validation.py [nodes]
"""

from __future__ import annotations

import sys
import time

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import torch

from common import footer, header, table
from gradsvc.engine import Engine, config_from_settings, warm_up_shape_check
from gradsvc.runtime.settings import Settings
from gradsvc.wire import GradientRequest

# One node of each kind reading the previous node `p` (and, for add, the one 7 before `q`).
OPS = {
    "tanh": lambda p, q: {"op": "aten.tanh.default", "args": [{"node": p}]},
    "add (two inputs)": lambda p, q: {"op": "aten.add.Tensor", "args": [{"node": p}, {"node": q}]},
    "linear": lambda p, q: {"op": "aten.linear.default", "args": [{"node": p}, {"node": "w2"}]},
    "softmax": lambda p, q: {"op": "aten._softmax.default", "args": [{"node": p}, -1, False]},
    "layer_norm": lambda p, q: {"op": "aten.layer_norm.default", "args": [{"node": p}, [4]]},
}


def request(n: int, node) -> GradientRequest:
    nodes = [{"name": "n0", "op": "aten.linear.default", "args": [{"node": "x"}, {"node": "w"}]}]
    nodes += [{"name": f"n{i}", **node(f"n{i - 1}", f"n{max(0, i - 7)}")} for i in range(1, n)]
    graph = {"inputs": [{"name": "x", "kind": "input", "dtype": "float32", "shape": [-1, 3]},
                        {"name": "w", "kind": "parameter", "target": "w", "dtype": "float32", "shape": [4, 3]},
                        {"name": "w2", "kind": "parameter", "target": "w2", "dtype": "float32", "shape": [4, 4]}],
             "nodes": nodes, "outputs": [{"node": nodes[-1]["name"]}], "dtype": "float32"}
    weights = {"w": {"dtype": "float32", "shape": [4, 3], "data": [[0.1] * 3] * 4},
               "w2": {"dtype": "float32", "shape": [4, 4], "data": [[0.1] * 4] * 4}}
    body = {"model": {"graph": graph, "weights": weights}, "inputs": [[0.1, 0.2, 0.3]] * 2,
            "targets": [[0.0] * 4] * 2, "loss": "mse", "options": {"numcheck": "off"}}
    return msgspec.json.decode(msgspec.json.encode(body), type=GradientRequest)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2_000
    torch.set_num_threads(1)
    warm_up_shape_check()
    engine = Engine(config_from_settings(Settings(max_graph_nodes=max(n, 1))))
    started = header(f"graph validation: a new graph of {n} nodes through prepare() on meta",
                     "Each op as a chain of nodes after a linear; one torch thread, as in the API.")
    rows = []
    for name, node in OPS.items():
        req = request(n, node)
        start = time.perf_counter()
        engine.prepare(req, "meta")
        s = time.perf_counter() - start
        rows.append([name, f"{s * 1e3:.0f} ms", f"{s / n * 1e6:.0f} us", f"{s / n * 5_000:.2f} s",
                     f"{s / n * 20_000:.2f} s"])
    table(["op", f"{n} nodes", "per node", "5,000 nodes", "20,000 nodes"], rows)
    footer(started)


if __name__ == "__main__":
    main()
