"""Where the API's CPU goes for one small job: the API process run under cProfile (the 6-8-3 tanh net, float64,
batch 4, numcheck off, memory off, JSON, POST /gradients?wait=30 from one keep-alive client, one request after
another), its cumulative and own times per request for the functions that take the most.

A private stack (tests/support/stack.py, one worker); the API it starts is replaced by one run under cProfile.

Run: .venv/bin/python bench/profile_api.py [N]
"""

from __future__ import annotations

import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import msgspec

from common import ROOT, footer, header, seed_a_body, start_stack
from tests.support.stack import wait_port

N, WARMUP = 400, 50
# The process's start-up (imports, dataclass builds) is profiled too: left out of the table.
_STARTUP = ("<frozen", "dataclasses.py", "importlib", "builtins.exec", "__import__", "marshal", "compile",
            "__build_class__", "builtins.getattr")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else N
    started = header("The API's CPU per small job, by function (cProfile)", __doc__.split("Run:")[0])
    stack = start_stack(workers=1)
    prof = tempfile.NamedTemporaryFile(suffix=".prof", delete=False).name
    try:
        stack.api.terminate()
        stack.api.wait(30)
        api = subprocess.Popen([sys.executable, "-m", "cProfile", "-o", prof, "-m", "gradsvc", "serve"],
                               env=stack.env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_port(stack.api_port, 120)
        content = msgspec.json.encode(seed_a_body({"numcheck": "off", "memory": False}))
        headers = {"Content-Type": "application/json", **stack.auth_headers()}
        with httpx.Client(base_url=stack.base_url, timeout=60, headers=headers) as c:
            for i in range(WARMUP + n):
                r = c.post("/gradients", params={"wait": 30}, content=content)
                assert r.status_code == 200, r.text[:300]
        api.send_signal(signal.SIGINT)
        api.wait(60)
        time.sleep(0.2)
    finally:
        stack.stop()
    stats = pstats.Stats(prof)
    os.unlink(prof)
    total = WARMUP + n
    print(f"\n{total} requests (the first {WARMUP} warm-up, included); ms per request\n")
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)
    print("| cumulative ms | own ms | calls/request | function |\n|---|---|---|---|")
    shown = 0
    for (path, line, name), (_, ncalls, own, cum, _) in rows:
        if ncalls < total or shown >= 30 or any(s in path + name for s in _STARTUP):
            continue
        shown += 1
        where = path.replace(str(ROOT) + "/", "").split("site-packages/")[-1]
        print(f"| {1e3 * cum / total:.3f} | {1e3 * own / total:.3f} | {ncalls / total:.1f} | {where}:{line} {name} |")
    footer(started)


if __name__ == "__main__":
    main()
