"""What options.curvature with options.shards costs each job: the request cut as the API cuts it
(service/fan_out.py), every job computed in this process one after another on one intra-op thread, its CPU
seconds (time.process_time) against the one job's, and the combined answer against the one job's.

  trace     a 46k-parameter CNN (Conv-ReLU-MaxPool x 2, Linear), batch 64 of 3x32x32, float32, cross entropy,
            curvature {top: 0, trace: true, probes: 20}: spread over the row shards (each does every probe on
            its rows).
  density   the same with {top: 0, density: true, probes: 4} (30 Lanczos steps each): the row shards compute
            the gradient only, the probes go to min(shards, 4) Lanczos jobs over the whole batch.
CPU seconds rather than wall time: on a shared machine they move less with the load (the largest job's share
is the speed-up a worker per job would give, roughly). One warm-up job first.

Run: .venv/bin/python bench/sharded_curvature.py
"""

from __future__ import annotations

import time

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import torch

from common import footer, header, table
from gradsvc.engine import EngineConfig, compute, prepare
from gradsvc.engine.reduce import reduce_results
from gradsvc.wire import GradientRequest
from service.fan_out import split
from tests.support.nets import tensor_json

LAYERS = [{"type": "Conv2d", "in_channels": 3, "out_channels": 16, "kernel_size": 3, "padding": 1},
          {"type": "ReLU"}, {"type": "MaxPool2d", "kernel_size": 2},
          {"type": "Conv2d", "in_channels": 16, "out_channels": 32, "kernel_size": 3, "padding": 1},
          {"type": "ReLU"}, {"type": "MaxPool2d", "kernel_size": 2}, {"type": "Flatten"},
          {"type": "Linear", "in_features": 32 * 8 * 8, "out_features": 10}]
CASES = {"trace": {"top": 0, "trace": True, "probes": 20}, "density": {"top": 0, "density": True, "probes": 4}}


def request(curvature: dict, shards: int = 1) -> GradientRequest:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    return msgspec.convert({"model": {"layers": LAYERS, "dtype": "float32", "seed": 0}, "inputs": tensor_json(x),
                            "targets": tensor_json(y), "loss": "cross_entropy",
                            "options": {"numcheck": "off", "memory": False, "curvature": curvature,
                                        "shards": shards}}, GradientRequest)


def cpu_s(req: GradientRequest):
    started = time.process_time()
    result = compute(req)
    return time.process_time() - started, result


def _against(got, want) -> str:
    if got.products != want.products:
        return f"products {got.products} vs {want.products}"
    if got.density is not None:
        same = got.density.eigenvalues == want.density.eigenvalues
        return "density nodes identical" if same else "density nodes differ"
    return f"trace rel. diff {abs(got.trace - want.trace) / abs(want.trace):.1e}"


def main() -> None:
    torch.set_num_threads(1)
    started = header("Sharded curvature: each job's CPU seconds against one job's", __doc__.split("\n\n")[0])
    rows = []
    for name, curvature in CASES.items():
        cpu_s(request(curvature))  # warm-up
        whole_s, whole = cpu_s(request(curvature))
        for count in (2, 4):
            req = request(curvature, count)
            cut = split(req, prepare(req, EngineConfig(), "meta"), count)
            times, parts = zip(*(cpu_s(msgspec.msgpack.decode(b, type=GradientRequest)) for b in cut.bodies))
            got = reduce_results(list(parts), cut.plan).curvature
            rows.append([name, count, whole_s, " ".join(f"{t:.2f}" for t in times), max(times) / whole_s,
                         _against(got, whole.curvature)])
    table(["curvature", "shards", "one job (s)", "each job (s)", "largest / one job", "answer vs one job"], rows)
    footer(started)


if __name__ == "__main__":
    main()
