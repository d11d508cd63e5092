"""gradsvc.malloc: the service's processes keep large buffers in the heap (glibc), and nothing breaks."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import os, time
from gradsvc.malloc import keep_large_buffers
assert keep_large_buffers()
raw = os.urandom(40_000_000)
for _ in range(3):
    buf = bytearray(len(raw)); buf[:] = raw; copy = bytes(buf)
    assert copy == raw
    del buf, copy
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_buffers_are_reused_and_correct():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_api_and_the_workers_turn_it_on():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert "keep_large_buffers(one_arena=True)" in (root / "service" / "app.py").read_text()
    assert "keep_large_buffers()" in (root / "workers" / "worker.py").read_text()
