"""The Lanczos basis of options.curvature: filled in place (gradsvc/engine/diagnostics/lanczos.py) against
re-stacking the whole basis every step, as it did before: the same 200 steps over 100,000 parameters with a
diagonal operator (so the products cost nothing beside the basis), each in its own process for its peak memory.

Prints each way's seconds and peak RSS and the ratios (re-stacked / in place).

Run: .venv/bin/python bench/lanczos_basis.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import common  # noqa: F401  (puts the repo on sys.path)

P, STEPS = 100_000, 200

CHILD = """
import resource, sys, time
import torch
from gradsvc.engine.diagnostics.lanczos import Tridiagonal, lanczos

def restacked(apply, start, steps):
    q = start / start.norm()
    basis, alpha, beta = [q], [], []
    for j in range(steps):
        w = apply(basis[j])
        alpha.append(float(w @ basis[j]))
        stacked = torch.stack(basis)
        w = w - stacked.T @ (stacked @ w)
        w = w - stacked.T @ (stacked @ w)
        b = float(w.norm())
        if j == steps - 1:
            return Tridiagonal(stacked, alpha, beta, b)
        beta.append(b)
        basis.append(w / b)

torch.set_num_threads(1)
P, steps = int(sys.argv[2]), int(sys.argv[3])
d = torch.linspace(1, 2, P, dtype=torch.float64)
run = lanczos if sys.argv[1] == "in_place" else restacked
started = time.perf_counter()
state = run(lambda v: d * v, torch.ones(P, dtype=torch.float64), steps)
print(time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, len(state.alpha))
"""


def measure(way: str) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this checkout's gradsvc
    out = subprocess.run([sys.executable, "-c", CHILD, way, str(P), str(STEPS)], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    return float(out[0]), int(out[1])


def main() -> None:
    (new_s, new_rss), (old_s, old_rss) = measure("in_place"), measure("restacked")
    print(f"Lanczos, {STEPS} steps over {P} parameters")
    print(f"  in place     {new_s:7.2f} s   peak RSS {new_rss / 2**20:6.0f} MiB")
    print(f"  re-stacked   {old_s:7.2f} s   peak RSS {old_rss / 2**20:6.0f} MiB")
    print(f"  ratio (re-stacked / in place): time {old_s / new_s:.1f}x, peak memory {old_rss / new_rss:.1f}x")


if __name__ == "__main__":
    main()
