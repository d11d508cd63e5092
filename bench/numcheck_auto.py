"""The numerical check `auto` chooses on the zoo of real models (tests/support/models.py) and the check's own
cases (tests/support/check_cases.py), and what it costs against its budget: the evaluations it planned against
the budget's (GRADSVC_NUMCHECK_BUDGET x a forward+backward + GRADSVC_NUMCHECK_BUDGET_MIN_S, counted on the
nominal machine of gradsvc/engine/numcheck/plan.py), and the check's CPU and wall seconds against the budget's
seconds (those evaluations on the nominal machine).

One compute() per model in this process, torch on one intra-op thread (the machine the nominal one was
calibrated on, bench/numcheck_calibrate.py), float32, the default options but memory accounting off; each
model exported by the SDK's torch.export path. "check CPU s" is the check's CPU time (time.thread_time, which
other processes' load does not inflate), "check wall s" its wall time, the median of REPEAT warm runs; the
check's whole cost (the float64 reference, the simulated rounding, the evaluations, a kink's settling).

Run: .venv/bin/python bench/numcheck_auto.py
"""

from __future__ import annotations

import importlib
import time

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import torch

from common import footer, header, median, table
from gradsvc.engine import Engine, EngineConfig
from gradsvc.engine.numcheck import plan as planning
from gradsvc.wire import GradientRequest
from tests.support.check_cases import VERDICT_CASES, wire_body
from tests.support.models import CASES

REPEAT = 3
compute_module = importlib.import_module("gradsvc.engine.compute")  # its numerical_check, wrapped
OWN_CASES = ("mnist_cnn", "policy_gradient_baseline", "vq_vae_commitment", "regression_loss_1e5",
             "dqn_target_network", "ema_teacher")


def request(case: tuple) -> GradientRequest:
    body = wire_body(case, numcheck="auto", memory=False, timing_repeat=1)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def cases() -> dict[str, tuple]:
    out = {}
    for name, make in CASES.items():
        model, x, y, loss = make(torch.float32)
        out[name] = (model, (x,), y, loss)
    return {**out, **{name: VERDICT_CASES[name]() for name in OWN_CASES}}


class Spy:
    """The check's CPU and wall seconds and its plan's work, around compute()'s numerical_check."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.work: planning.Work | None = None
        self.plan: planning.Plan | None = None
        real_check, real_plan = compute_module.numerical_check, planning.plan_for

        def check(*args, **kwargs):
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return real_check(*args, **kwargs)
            finally:
                self.cpu, self.wall = time.thread_time() - c0, time.perf_counter() - w0

        def plan_for(options, config, work, sizes):
            self.work, self.plan = work, real_plan(options, config, work, sizes)
            return self.plan

        compute_module.numerical_check, planning.plan_for = check, plan_for


def main() -> list[list]:
    started = header("Numerical check auto on the zoo: the mode it chose, its evaluations and its CPU and wall "
                     "seconds against the budget's", __doc__.split("Run:")[0])
    torch.set_num_threads(1)
    config, cpu = EngineConfig(), torch.device("cpu")
    engine, spy = Engine(config), Spy()
    rows = []
    for name, case in cases().items():
        req = request(case)
        engine.compute(req, device=cpu)  # warm-up
        runs = []
        for _ in range(REPEAT):
            r = engine.compute(req, device=cpu)
            runs.append((spy.cpu, spy.wall, r))
        r = runs[0][2]
        check_cpu, check_wall = median(c for c, _, _ in runs), median(w for _, w, _ in runs)
        budget_s = r.numcheck.budget_evaluations * planning.nominal_eval_s(spy.work)
        verdicts = [p.judged for p in r.numcheck.per_parameter.values()]
        rows.append([name, r.parameter_count, r.numcheck.mode, spy.plan.evaluations, r.numcheck.evaluations,
                     r.numcheck.budget_evaluations, 1e3 * planning.nominal_eval_s(spy.work), check_cpu, check_wall,
                     budget_s, check_cpu / budget_s, "yes" if check_cpu <= budget_s else "NO",
                     "yes" if all(x.numcheck.passed for _, _, x in runs) else "NO",
                     " ".join(f"{v}:{verdicts.count(v)}" for v in ("ratio", "floor", "zero", "kink") if v in verdicts)])
    table(["model", "P", "auto mode", "planned evals", "evals", "budget evals", "nominal eval ms", "check CPU s",
           "check wall s", "budget s", "CPU / budget", "CPU within", "passed", "judged"], rows)
    over = [r[0] for r in rows if r[11] != "yes"]
    print(f"\ngoal every check's CPU time within its budget: {'met' if not over else 'NOT met: ' + ', '.join(over)}")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
