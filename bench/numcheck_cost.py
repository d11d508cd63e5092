"""Numerical check cost against parameter count: `exact` (2P loss evaluations) vs `directional`
(2 x GRADSVC_NUMCHECK_DIRECTIONS = 32 evaluations whatever P).

One compute() per row, in this process: an MLP 32 -> H -> 10 (tanh), float32, batch 16, cross-entropy,
memory accounting off, timing_repeat 5 (so "f+b ms" is the median of 5 warm forward+backward passes);
H is chosen for the parameter count P. The check runs in float64 on a copy of the model. "x f+b"
divides the check's time by the request's own forward+backward time. Exact is measured up to 2,000
parameters only (it takes ~15 s at 10,000) and extrapolated above from the largest measured row (its
cost per evaluation x 2P, a lower bound since each evaluation grows with P).

Run: .venv/bin/python bench/numcheck_cost.py
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import torch

from common import footer, header, median, raw_tensor, table
from gradsvc.engine import Engine, EngineConfig
from gradsvc.wire import GradientRequest

HIDDEN = [2, 24, 240, 2400, 24000]  # P = 43H + 10: 96, 1042, 10330, 103210, 1032010
EXACT_MEASURED_MAX = 2_000  # above, exact is extrapolated (10,090 parameters would take ~15 s)
REPEAT = 3


def request(hidden: int, mode: str) -> GradientRequest:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    body = {"model": {"layers": [{"type": "Linear", "in_features": 32, "out_features": hidden}, {"type": "Tanh"},
                                 {"type": "Linear", "in_features": hidden, "out_features": 10}],
                      "dtype": "float32", "seed": 0},
            "inputs": raw_tensor(x), "targets": raw_tensor(y), "loss": "cross_entropy",
            "options": {"numcheck": mode, "memory": False, "timing_repeat": 5}}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def run(hidden: int, mode: str) -> tuple[float, int, float, bool]:
    engine, cpu = Engine(EngineConfig()), torch.device("cpu")
    req = request(hidden, mode)
    engine.compute(req, device=cpu)  # warm-up
    results = [engine.compute(req, device=cpu) for _ in range(REPEAT)]
    ms = median(r.timings.numcheck_ms for r in results)
    fb = median(r.timings.forward_ms + r.timings.backward_ms for r in results)
    r = results[0]
    return ms, r.numcheck.evaluations, fb, r.numcheck.passed


def main() -> list[list]:
    started = header("Numerical check cost vs parameter count: exact (2P) vs directional (constant)",
                     __doc__.split("Run:")[0])
    rows = []
    per_eval = None
    for h in HIDDEN:
        p = 43 * h + 10
        d_ms, d_evals, fb, d_ok = run(h, "directional")
        if p <= EXACT_MEASURED_MAX:
            e_ms, e_evals, _, e_ok = run(h, "exact")
            per_eval = e_ms / e_evals
            exact = [e_evals, e_ms, e_ms / fb, "yes" if e_ok else "no"]
        else:
            est = per_eval * 2 * p
            exact = [2 * p, f"~{est:.0f} (est.)", f"~{est / fb:.0f}", "skipped"]
        rows.append([p, fb, *exact, d_evals, d_ms, d_ms / fb, d_ms / d_evals, "yes" if d_ok else "no"])
    table(["P", "f+b ms", "exact evals", "exact ms", "exact x f+b", "exact passed", "dir. evals", "dir. ms",
           "dir. x f+b", "dir. ms/eval", "dir. passed"], rows)
    evals = {r[6] for r in rows}
    print(f"\ngoal directional evaluations independent of P: {sorted(evals)} "
          f"({'met' if len(evals) == 1 else 'NOT met'}); its time grows only with the cost of one loss "
          "evaluation (a float64 forward), as 'dir. ms/eval' shows")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
