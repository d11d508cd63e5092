"""Calibrates the numerical check's nominal machine (gradsvc/engine/numcheck/plan.py: NOMINAL_EVAL_S, NOMINAL_OP_S,
NOMINAL_ELEMENT_S, NOMINAL_FLOP_S) on the zoo: for each model of tests/support/models.py's CASES and the
check's own cases (tests/support/check_cases.py: the MNIST example's CNN, a policy gradient, a VQ-VAE, a
regression), the float64 reference the check builds, what one evaluation does (ops, output elements, flops)
and what one evaluation of its loss costs in CPU time (time.thread_time, torch on one intra-op thread, the
median of repeated evaluations under no_grad, as the check's loop runs them). CPU time is what other
processes' load does not inflate the way wall time does (a shared machine: wall time is printed beside it).

Then a least-squares fit of CPU seconds per evaluation = e + a x ops + b x elements + c x flops, relative to
each model's time (no model weighs more for being slow), non-negative, and the constants that make every
measured model's evaluation at most its nominal one (the fit scaled by its largest measured/fitted ratio).

Run: .venv/bin/python bench/numcheck_calibrate.py
"""

from __future__ import annotations

import itertools
import time

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import numpy as np
import torch

from common import footer, header, median, table
from gradsvc.engine import EngineConfig
from gradsvc.engine.numcheck import plan as planning
from gradsvc.engine.numcheck.reference import Reference
from gradsvc.engine.prepare import prepare
from gradsvc.wire import GradientRequest
from tests.support.check_cases import VERDICT_CASES, wire_body
from tests.support.models import CASES

MIN_CPU_S = 0.3  # each model's evaluations are repeated until they took this much CPU time (and at least 5)


def _wide_mlp(width: int, batch: int) -> tuple:
    """An MLP whose matmuls outweigh its ops and elements: 256 -> width -> width -> 10, tanh."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                torch.nn.Tanh(), torch.nn.Linear(width, 10))
    return model, (torch.randn(batch, 256, generator=g),), torch.randint(0, 10, (batch,), generator=g), "cross_entropy"


def _mnist(batch: int) -> tuple:
    model, (x,), _, loss = VERDICT_CASES["mnist_cnn"]()
    g = torch.Generator().manual_seed(2)
    return model, (torch.randn(batch, *x.shape[1:], generator=g),), torch.randint(0, 10, (batch,), generator=g), loss


def cases() -> dict[str, tuple]:
    """The zoo, the check's own cases, and a few models whose arithmetic outweighs their ops (wide MLPs, the
    MNIST CNN on a larger batch), each (model, inputs, targets, loss) as check_cases builds them."""
    out = {}
    for name, make in CASES.items():
        model, x, y, loss = make(torch.float32)
        out[name] = (model, (x,), y, loss)
    for name in ("mnist_cnn", "policy_gradient_baseline", "vq_vae_commitment", "regression_loss_1e5",
                 "dqn_target_network", "ema_teacher"):
        out[name] = VERDICT_CASES[name]()
    out["mnist_cnn_batch_16"] = _mnist(16)
    out["mlp_256_1024_batch_64"] = _wide_mlp(1024, 64)
    out["mlp_256_512_batch_8"] = _wide_mlp(512, 8)
    return out


def per_evaluation(ref: Reference) -> tuple[float, float]:
    """(CPU s, wall s) of one evaluation of the reference's loss, medians, on one thread."""
    cpu, wall = [], []
    with torch.no_grad():
        ref.loss_fn()  # warm
        while sum(cpu) < MIN_CPU_S or len(cpu) < 5:
            c0, w0 = time.thread_time(), time.perf_counter()
            ref.loss_fn()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
            if len(cpu) >= 200:
                break
    return median(cpu), median(wall)


def fit(work: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative least squares of seconds ~ work @ c relative to each row's seconds: every subset of the
    columns, the best fit whose coefficients are all non-negative."""
    a, b = work / seconds[:, None], np.ones(len(seconds))
    best, best_err = np.zeros(work.shape[1]), np.inf
    for k in range(1, work.shape[1] + 1):
        for cols in itertools.combinations(range(work.shape[1]), k):
            c, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (c < 0).any():
                continue
            err = float(((a[:, cols] @ c - b) ** 2).sum())
            if err < best_err:
                best, best_err = np.zeros(work.shape[1]), err
                best[list(cols)] = c
    return best


def _constants(c) -> str:
    return (f"{c[0] * 1e6:.3g} us per evaluation, {c[1] * 1e6:.3g} us per op, {c[2] * 1e9:.3g} ns per element, "
            f"{c[3] * 1e12:.3g} ps per flop")


def main() -> list[list]:
    started = header("Numerical check: a float64 evaluation's CPU cost on the zoo, and the nominal machine fitted to it",
                     __doc__.split("Run:")[0])
    torch.set_num_threads(1)
    config, cpu = EngineConfig(), torch.device("cpu")
    rows, work, seconds = [], [], []
    for name, case in cases().items():
        req = msgspec.msgpack.decode(msgspec.msgpack.encode(wire_body(case, numcheck="auto")), type=GradientRequest)
        prep = prepare(req, config, cpu)
        ref = Reference(prep, req, cpu)
        c, w = per_evaluation(ref)
        now = planning.nominal_eval_s(ref.work)
        rows.append([name, ref.work.ops, ref.work.elements, ref.work.flops, 1e3 * c, 1e3 * w, 1e3 * now, c / now])
        work.append([1, ref.work.ops, ref.work.elements, ref.work.flops])
        seconds.append(c)
    work_a, seconds_a = np.array(work, dtype=float), np.array(seconds)
    c = fit(work_a, seconds_a)
    scale = float((seconds_a / (work_a @ c)).max())
    upper = c * scale
    for row, pred in zip(rows, work_a @ upper):
        row += [1e3 * pred, row[4] / (1e3 * pred)]
    table(["model", "ops", "elements", "flops", "CPU ms", "wall ms", "nominal ms now", "CPU / now",
           "nominal ms fitted", "CPU / fitted"], rows)
    print(f"\nfit (relative least squares): {_constants(c)}")
    print(f"scaled by {scale:.3g} (every model's CPU time at most its nominal): {_constants(upper)}")
    now = [planning.NOMINAL_EVAL_S, planning.NOMINAL_OP_S, planning.NOMINAL_ELEMENT_S, planning.NOMINAL_FLOP_S]
    print(f"in use: {_constants(now)}")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
