"""A session over several workers against one: the 23M-parameter GPT-2 of bench/large_model.py (6 layers, width
512, vocabulary 8,192, every position's next-token loss), batch 16 x 128 tokens, float32, AdamW, as a session held
by one worker and as one held by k (default 2), on one stack of k workers with the same torch threads each (the
host's cores / k: GRADSVC_WORKERS=k). The steps alternate between the two sessions, so that a drifting machine
speed hits both; printed: each one's median step (seconds through the SDK), the speed-up, each member's rows,
compute and all-reduce from the last answer, and how far the two sessions' weights end apart (relative to each
tensor's norm).

Run: .venv/bin/python bench/session_workers.py [k] [--steps N]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import common  # noqa: F401  (puts the repo on sys.path)
import torch

from common import footer, header, start_stack, table
from gradclient import Client
from tests.support.models import GPT2_23M, GPT2LM


def main(argv: list[str]) -> None:
    k = int(next((a for a in argv if a.isdigit()), "2"))
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 5
    started = header("session over several workers", f"GPT-2 23M, batch 16 x 128, AdamW: a session on one worker "
                     f"against one on {k}, {k} workers of {max(1, torch.get_num_threads() // k)} thread(s) each")
    torch.manual_seed(0)
    model = GPT2LM(**GPT2_23M)
    g = torch.Generator().manual_seed(1)
    data = [(ids := torch.randint(0, 8192, (16, 128), generator=g), torch.roll(ids, -1, 1).flatten())
            for _ in range(steps + 1)]
    stack = start_stack(k, GRADSVC_WORKERS=str(k), GRADSVC_TENSOR_BUDGET_BYTES=str(4 << 30))
    times: dict[int, list[float]] = {1: [], k: []}
    try:
        with Client(stack.base_url, timeout=900) as client:
            sessions = {n: client.session(copy.deepcopy(model), "adamw", lr=1e-4, workers=n) for n in (1, k)}
            for s in sessions.values():
                s.step(*data[0])  # creates it: the export, the upload, the build
            last = None
            for x, y in data[1:]:
                for n, s in sessions.items():
                    t = time.perf_counter()
                    out = s.step(x, y)
                    times[n].append(time.perf_counter() - t)
                    last = out if n == k else last
            weights = {n: s.state_dict() for n, s in sessions.items()}
            for s in sessions.values():
                s.delete()
    finally:
        stack.stop()
    one, many = statistics.median(times[1]), statistics.median(times[k])
    table(["session", "median step s", "speed-up"], [["1 worker", one, "1.00x"], [f"{k} workers", many,
                                                                                 f"{one / many:.2f}x"]])
    table(["member", "rows", "compute ms", "all-reduce ms"],
          [[m.worker, m.rows, m.compute_ms, m.allreduce_ms] for m in last.raw.members])
    apart = sorted((float((weights[k][n] - w).norm() / w.norm()), n) for n, w in weights[1].items() if w.norm() > 0)
    print(f"weights after {steps + 1} steps: the {k}-worker session's within {apart[-1][0]:.1e} of the one-worker's "
          f"(relative to each tensor's norm; the largest {apart[-1][1]}, the median {apart[len(apart) // 2][0]:.1e})")
    footer(started)


if __name__ == "__main__":
    main(sys.argv[1:])
