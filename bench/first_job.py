"""The first job after start-up against the ones after it: does anything a process pays once (torch's meta
kernels for the shape check, BLAS workspaces) still land on a user's request? Reports the ratio of the first
request's end-to-end time to the median of the next ones, and where the worker says the time went.

Run: .venv/bin/python bench/first_job.py [rounds]   (each round starts a fresh stack)
"""

from __future__ import annotations

import statistics
import sys
import time

from common import footer, header, seed_a_body, start_stack, table



def one_round(n: int = 6) -> tuple[float, float, dict]:
    import httpx

    stack = start_stack(workers=1)
    try:
        body = seed_a_body({"numcheck": "off"})
        times, first_timings = [], {}
        for i in range(n):
            t = time.perf_counter()
            r = httpx.post(f"{stack.base_url}/gradients?wait=30", json=body, timeout=120)
            times.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
            if i == 0:
                first_timings = r.json()["timings"]
        return times[0], statistics.median(times[1:]), first_timings
    finally:
        stack.stop()


def main(rounds: int = 2) -> None:
    started = header("First job after start-up", __doc__.split("\n\n")[0])
    rows = []
    for r in range(rounds):
        first, steady, t = one_round()
        phases = t["prepare_ms"] + t["forward_ms"] + t["backward_ms"] + t["memory_ms"] + t["numcheck_ms"]
        rows.append([r + 1, 1e3 * first, 1e3 * steady, first / steady, t["prepare_ms"], t["total_ms"],
                     t["total_ms"] / phases if phases else 0.0])
    table(["round", "first ms", "next ms (median)", "first / next", "first prepare_ms", "first total_ms",
           "total / phases"], rows)
    footer(started)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
