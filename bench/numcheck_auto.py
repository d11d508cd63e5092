"""The numerical check `auto` chooses on the zoo of real models (tests/support/models.py), and what it costs
against its budget (GRADSVC_NUMCHECK_BUDGET x the job's forward+backward + GRADSVC_NUMCHECK_BUDGET_MIN_S).

One compute() per model in this process (the service adds nothing to the check), float32, the default
options but memory accounting off and timing_repeat 3 ("f+b ms" the median of the warm passes); each model
exported by the SDK's torch.export path. "check x f+b" divides the check's time by that forward+backward.

Run: .venv/bin/python bench/numcheck_auto.py
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import torch

from common import footer, header, median, table
from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc.engine import Engine, EngineConfig
from gradsvc.wire import GradientRequest
from tests.support.models import CASES

REPEAT = 3


def request(case: str) -> GradientRequest:
    model, x, y, loss = CASES[case](torch.float32)
    eg = export_graph(model, (x,))
    body = {"model": {"graph": eg.graph, "dtype": "float32", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": loss,
            "options": {"numcheck": "auto", "memory": False, "timing_repeat": 3}}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def main() -> list[list]:
    started = header("Numerical check auto on the zoo: the mode it chose, its evaluations, its cost against the budget",
                     __doc__.split("Run:")[0])
    config, cpu = EngineConfig(), torch.device("cpu")
    engine = Engine(config)
    rows = []
    for case in CASES:
        req = request(case)
        engine.compute(req, device=cpu)  # warm-up
        results = [engine.compute(req, device=cpu) for _ in range(REPEAT)]
        r = results[len(results) // 2]
        ms = median(x.timings.numcheck_ms for x in results)
        fb = median(x.timings.forward_ms + x.timings.backward_ms for x in results)
        budget = config.numcheck_budget * fb + 1e3 * config.numcheck_budget_min_s
        verdicts = [p.judged for p in r.numcheck.per_parameter.values()]
        rows.append([case, r.parameter_count, r.numcheck.mode, r.numcheck.evaluations, fb, ms, ms / fb, budget,
                     "yes" if ms <= budget else "NO", "yes" if all(x.numcheck.passed for x in results) else "NO",
                     " ".join(f"{v}:{verdicts.count(v)}" for v in ("ratio", "floor", "zero") if v in verdicts)])
    table(["model", "P", "auto mode", "evals", "f+b ms", "check ms", "check x f+b", "budget ms", "within",
           "passed", "judged"], rows)
    over = [r[0] for r in rows if r[8] != "yes"]
    print(f"\ngoal every check within its budget: {'met' if not over else 'NOT met: ' + ', '.join(over)}")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
