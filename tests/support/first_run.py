"""A new user's first minutes, as CI runs them on a clean clone before any test tool is installed:
`make run` (which creates .venv/ with only the `server` extra and torch), then the README's first curl request,
the README's SDK block and the first block of docs/sessions.md against it, each compared with the answer its page
prints (tests/support/doc_blocks.py's rule), then the stack stopped with Ctrl-C and nothing left serving.

    python3 -m tests.support.first_run      # from the repository root; the standard library only

Exits non-zero, saying which step and why, when `make run` does not serve within the time it is given, when a
block's answer differs from its page, or when the stack does not stop.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.support.doc_blocks import (README, ROOT, abridged_answers, agrees, expected_lines, parse_abridged,
                                      run_curl, sdk_snippets)

BASE_URL = "http://127.0.0.1:8000"  # the README's address: `make run` with no settings
SESSIONS = ROOT / "docs" / "sessions.md"
SERVE_WITHIN_S = 1500  # creating .venv/ and installing torch and the server extra the first time, then starting
STOP_WITHIN_S = 60


def _ready() -> bool:
    try:
        with urllib.request.urlopen(f"{BASE_URL}/readyz", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _port_open() -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", 8000)) == 0


def _python_block(path: Path) -> str:
    blocks = sdk_snippets(path)
    if not blocks:
        raise SystemExit(f"{path.name}: no Python block with a Client( and a `# ->` line")
    return blocks[0]


def _check_python(name: str, block: str, python: Path) -> None:
    out = subprocess.run([str(python), "-c", block], capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{name} exited {out.returncode}:\n{out.stderr[-3000:]}")
    printed = out.stdout.strip().splitlines()[-1]
    problems = agrees(parse_abridged(expected_lines(block)), json.loads(printed))
    if problems:
        raise SystemExit(f"{name} printed {printed}, which is not what its page shows: {problems}")
    print(f"first run: {name} printed what its page shows: {printed}")


def _check_curl() -> None:
    example, answer = abridged_answers(README)[0]
    out = run_curl(example, BASE_URL)
    if out.returncode != 0:
        raise SystemExit(f"the README's first curl exited {out.returncode}: {out.stderr[-2000:]}")
    body = json.loads(out.stdout)
    problems = agrees(parse_abridged(answer), body)
    if problems:
        raise SystemExit(f"the README's first curl answered differently from the page: {problems}")
    print(f"first run: the README's curl answered what the page shows (loss {body['loss']:.4f}, "
          f"numcheck passed: {body['numcheck']['passed']})")


def main() -> int:
    venv = ROOT / ".venv"
    if venv.exists():
        raise SystemExit(f"{venv} exists: the first run needs a clean clone, where `make run` creates it")
    if _port_open():
        raise SystemExit("127.0.0.1:8000 is taken: the README's address must be free for `make run`")
    started = time.monotonic()
    make = subprocess.Popen(["make", "run"], cwd=ROOT, start_new_session=True)
    try:
        while not _ready():
            if make.poll() is not None:
                raise SystemExit(f"`make run` exited {make.returncode} before it served")
            if time.monotonic() - started > SERVE_WITHIN_S:
                raise SystemExit(f"`make run` did not serve {BASE_URL}/readyz within {SERVE_WITHIN_S} s")
            time.sleep(1)
        print(f"first run: `make run` served in {time.monotonic() - started:.0f} s")
        if (venv / "bin" / "pytest").exists():
            raise SystemExit("`make run` installed the test tools: the venv is not what a user's holds")
        python = venv / "bin" / "python"
        _check_curl()
        _check_python("the README's SDK block", _python_block(README), python)
        _check_python("docs/sessions.md's first block", _python_block(SESSIONS), python)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole foreground group
            try:
                make.wait(STOP_WITHIN_S)
            except subprocess.TimeoutExpired:
                os.killpg(make.pid, signal.SIGKILL)
                raise SystemExit(f"`make run` did not stop within {STOP_WITHIN_S} s of Ctrl-C")
    deadline = time.monotonic() + 10
    while _port_open():
        if time.monotonic() > deadline:
            raise SystemExit("something still serves 127.0.0.1:8000 after `make run` stopped")
        time.sleep(0.2)
    print("first run: `make run` stopped on Ctrl-C, nothing left serving")
    return 0


if __name__ == "__main__":
    sys.exit(main())
