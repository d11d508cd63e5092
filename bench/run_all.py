"""Runs every bench in turn, each in its own process (`make bench`), and prints their tables.

Run: .venv/bin/python bench/run_all.py [--quick] [name ...]   (names: engine_overhead small_job medium_job
throughput payload numcheck_cost sharding first_job graph_overhead summary; default all). The last one,
summary, prints the request path's figures against their goals as one table; `--quick` runs it alone, shorter
(`.venv/bin/python bench/run_all.py --quick`).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["engine_overhead", "small_job", "request_cost", "medium_job", "throughput", "payload", "numcheck_cost", "numcheck_auto", "sharding", "first_job",
           "graph_overhead", "summary"]  # summary last: `make bench` ends with its one table


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    argv = [a for a in argv if a != "--quick"]
    names = argv or (["summary"] if quick else BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"unknown bench {unknown}; choose from {BENCHES}", file=sys.stderr)
        return 2
    import torch

    one, five, _ = os.getloadavg()
    print(f"# gradsvc benchmarks\n\n{platform.platform()}, Python {platform.python_version()}, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), {os.cpu_count()} cores; "
          f"load {one:.2f} (1 min) {five:.2f} (5 min) at start")
    started = time.perf_counter()
    failed = []
    for name in names:
        extra = ["--quick"] if quick and name == "summary" else []
        rc = subprocess.call([sys.executable, str(HERE / f"{name}.py"), *extra], cwd=HERE.parent)
        if rc != 0:
            failed.append(name)
    one, five, _ = os.getloadavg()
    print(f"\nall benches took {time.perf_counter() - started:.0f} s; load {one:.2f} (1 min) {five:.2f} (5 min) "
          f"at the end" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
