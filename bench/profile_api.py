"""Where a small job's time goes on the API's side: the 6-8-3 tanh net, float64, batch 4, numcheck off, memory
off, JSON, POST /gradients?wait=30 from one keep-alive client, one request after another.

1. CPU per request by process, unprofiled: the API, the worker, Redis (each process's user + system time
   from /proc over N requests) and this client, with the wall time per request. `--against DIR` runs a
   stack from another checkout too (`git worktree add DIR COMMIT`), the two alternately, ROUNDS times each,
   so the machine's drift falls on both.
2. The API's CPU per request by function: the API run under cProfile on its main thread's CPU clock
   (time.thread_time; a wall clock charges a function with the time the 2 cores spent on Redis and the worker
   while it ran: asyncio's socket write looked like 0.76 ms a request that way), profiling only the N
   requests (SIGUSR1 starts it after the warm-up, SIGUSR2 stops it), so about 2-3x the unprofiled time.
   The named steps of the request first, then the functions that take the most.

A private stack (tests/support/stack.py, one worker); for 2. its API is replaced by one run under cProfile.

Run: .venv/bin/python bench/profile_api.py [N] [--against DIR]
"""

from __future__ import annotations

import os
import sys

if len(sys.argv) > 2 and sys.argv[1] == "--serve-profiled":  # the API process of part 2 (no bench import)
    import cProfile
    import signal
    import time

    sys.path.insert(0, os.getcwd())  # the checkout the stack runs (its cwd)
    _prof, _out = cProfile.Profile(time.thread_time), sys.argv[2]
    signal.signal(signal.SIGUSR1, lambda *_: _prof.enable())
    signal.signal(signal.SIGUSR2, lambda *_: (_prof.disable(), _prof.dump_stats(_out)))
    sys.argv = ["gradsvc", "serve"]
    from gradsvc.runtime.cli import main as _serve

    _serve()
    sys.exit(0)

import pstats
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import msgspec
from common import ROOT, footer, header, median, seed_a_body, start_stack, table

from tests.support import stack as stack_module
from tests.support.stack import wait_port

N, WARMUP, ROUNDS = 600, 100, 3
# The request's named steps (part 2): (label, file suffix, function), each found in this checkout or an older one.
STEPS = [
    ("the ASGI call in all (uvicorn, Litestar, the middlewares)", "uvicorn/middleware/proxy_headers.py", "__call__"),
    ("... the route (`submit_gradients`)", "service/gradient_routes.py", "submit_gradients"),
    ("... ... the body read and decoded (`read_request`)", "service/parsing.py", "read_request"),
    ("... ... the check on meta (`prepare_inline`: engine.prepare, a spec seen before)", "service/submission.py",
     "prepare_inline"),
    ("... ... the enqueue and the wait, written together (`_enqueue_and_wait`)", "service/submission.py",
     "_enqueue_and_wait"),
    ("... ... ... the job's commands (`plain_commands`: RQ's record from the template)", "service/enqueue.py",
     "plain_commands"),
    ("... ... ... their replies read (`Exchange.read`)", "gradsvc/broker/connection.py", "read"),
    ("... ... the enqueue (`enqueue_async`)", "service/enqueue.py", "enqueue_async"),
    ("... ... ... RQ's enqueue into a pipeline (`_enqueue_plain`)", "service/enqueue.py", "_enqueue_plain"),
    ("... ... the wait (`JobReader.wait`: XREAD and GET)", "service/job_reader.py", "wait"),
    ("... ... the answer (`_answer`: the result's JSON)", "service/gradient_routes.py", "_answer"),
    ("... Litestar's response sent", "litestar/response/base.py", "__call__"),
    ("... the metrics middleware's own (its wrapper, not what it wraps)", "service/api_metrics.py", "wrapped"),
]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client(stack) -> tuple[httpx.Client, bytes]:
    headers = {"Content-Type": "application/json", **stack.auth_headers()}
    content = msgspec.json.encode(seed_a_body({"numcheck": "off", "memory": False}))
    return httpx.Client(base_url=stack.base_url, timeout=60, headers=headers), content


def _post(c: httpx.Client, content: bytes, n: int) -> None:
    for _ in range(n):
        r = c.post("/gradients", params={"wait": 30}, content=content)
        assert r.status_code == 200, r.text[:300]


def cpu_split(root: Path, n: int) -> dict[str, float]:
    """ms per request: wall, and each process's CPU, for a stack run from `root`'s checkout."""
    stack_module.ROOT = root
    stack = start_stack(workers=1)
    try:
        pids = {"API": stack.api.pid, "worker": stack.workers[0].pid, "Redis": stack.redis.proc.pid}
        c, content = _client(stack)
        with c:
            _post(c, content, WARMUP)
            before = {k: _cpu_s(p) for k, p in pids.items()}
            mine, t0 = time.process_time(), time.perf_counter()
            _post(c, content, n)
            wall, mine = time.perf_counter() - t0, time.process_time() - mine
            after = {k: _cpu_s(p) for k, p in pids.items()}
    finally:
        stack.stop()
        stack_module.ROOT = ROOT
    out = {"wall": 1e3 * wall / n, **{k: 1e3 * (after[k] - before[k]) / n for k in pids}, "client": 1e3 * mine / n}
    out["load"] = _load1()
    return out


def split_table(n: int, against: Path | None) -> None:
    trees = [("this checkout", ROOT)] + ([(f"{against}", against)] if against else [])
    got: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for _ in range(ROUNDS if against else 1):
        for label, root in trees:
            got[label].append(cpu_split(root, n))
    keys = ["wall", "API", "worker", "Redis", "client"]
    rows = [[label, i + 1, *[r[k] for k in keys], r["load"]] for label, _ in trees for i, r in enumerate(got[label])]
    rows += [[label, "median", *[median([r[k] for r in got[label]]) for k in keys], ""] for label, _ in trees]
    print(f"\n1. ms per request ({n} requests after {WARMUP} of warm-up), CPU by process (user + system)\n")
    table(["checkout", "round", "wall", "API CPU", "worker CPU", "Redis CPU", "client CPU", "load (1 min)"], rows)


def profiled(n: int, root: Path) -> pstats.Stats:
    """The API's profile over n requests, for a stack run from `root`'s checkout."""
    stack_module.ROOT = root
    stack = start_stack(workers=1)
    fd, prof = tempfile.mkstemp(suffix=".prof")
    os.close(fd)
    try:
        stack.api.terminate()
        stack.api.wait(30)
        api = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-profiled", prof],
                               env=stack.env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_port(stack.api_port, 120)
        c, content = _client(stack)
        with c:
            _post(c, content, WARMUP)
            api.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            _post(c, content, n)
            api.send_signal(signal.SIGUSR2)
            time.sleep(1)
        api.terminate()
        api.wait(60)
        return pstats.Stats(prof)
    finally:
        stack.stop()
        stack_module.ROOT = ROOT
        os.unlink(prof)


def _step_ms(stats: pstats.Stats, path: str, name: str, n: int) -> str:
    """A step's cumulative ms per request (own, for the metrics middleware's wrapper); "" where absent."""
    found = [(own, cum) for (p, _, f), (_, _, own, cum, _) in stats.stats.items() if p.endswith(path) and f == name]
    if not found:
        return ""
    own, cum = max(found, key=lambda oc: oc[1])
    ms = 1e3 * (own if path.endswith("api_metrics.py") else cum) / n
    return f"{ms:.3f}" if ms >= 0.01 else ""


def function_table(profiles: list[tuple[str, pstats.Stats]], n: int) -> None:
    print(f"\n2. The API's CPU per request under cProfile (thread CPU clock), {n} requests; ms per request\n")
    print("| step | " + " | ".join(label for label, _ in profiles) + " |\n|---|" + "---|" * len(profiles))
    for label, path, name in STEPS:
        cells = [_step_ms(stats, path, name, n) for _, stats in profiles]
        if any(cells):
            print(f"| {label} | " + " | ".join(cells) + " |")
    label, stats = profiles[0]
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:30]
    print(f"\n{label}: the functions that take the most\n\n| cumulative ms | own ms | function |\n|---|---|---|")
    for (path, line, name), (_, _, own, cum, _) in rows:
        where = path.replace(str(ROOT) + "/", "").split("site-packages/")[-1]
        print(f"| {1e3 * cum / n:.3f} | {1e3 * own / n:.3f} | {where}:{line} {name} |")


def main() -> None:
    args, against = sys.argv[1:], None
    if "--against" in args:
        at = args.index("--against")
        against, args = Path(args[at + 1]).resolve(), args[:at] + args[at + 2:]
    n = int(args[0]) if args else N
    started = header("Where a small job's time goes on the API's side", __doc__.split("Run:")[0])
    split_table(n, against)
    trees = [("this checkout", ROOT)] + ([(str(against), against)] if against else [])
    function_table([(label, profiled(n, root)) for label, root in trees], n)
    footer(started)



def _load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


if __name__ == "__main__":
    main()
