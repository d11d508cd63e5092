"""gradsvc.runtime.malloc: the service's processes keep large buffers in the heap (glibc), and nothing breaks."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import os, time
from gradsvc.runtime.malloc import keep_large_buffers
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

    root = Path(__file__).resolve().parents[3]
    assert "keep_large_buffers(one_arena=True)" in (root / "service" / "app.py").read_text()
    assert "keep_large_buffers()" in (root / "workers" / "main.py").read_text()


THREADS = """
import os, resource, sys
from concurrent.futures import ThreadPoolExecutor
from gradsvc.runtime.malloc import keep_large_buffers
assert keep_large_buffers(one_arena=sys.argv[1] == "one")
raw = os.urandom(30_000_000)
def work():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [bytearray(raw) for _ in range(3)]  # 90 MB: more than a thread arena's 64 MiB heap
    del bufs
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
with ThreadPoolExecutor(1) as pool:
    faults = [pool.submit(work).result() for _ in range(5)]
print(max(faults[1:]))  # after the first round, which maps the heap either way
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_one_arena_lets_a_thread_reuse_large_buffers_too():
    """In a thread, 90 MB of buffers come from fresh pages every time (the thread's arena heaps are mapped and
    unmapped) unless the main arena serves every thread: what the API turns on, as its threads check and
    enqueue large requests."""
    faults = {}
    for mode in ("default", "one"):
        out = subprocess.run([sys.executable, "-c", THREADS, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        faults[mode] = int(out.stdout)
    assert faults["one"] < 100 < 1000 < faults["default"], faults


KEEPER = """
import sys
from gradsvc.runtime.malloc import MemoryKeeper, keep_large_buffers, resident_bytes
assert keep_large_buffers()
keeper = MemoryKeeper(slack_bytes=64 << 20)
rest = resident_bytes()
chunks = [bytearray(b"x" * (1 << 20)) for _ in range(300)]  # 300 MB a job left behind, freed but for a few
pinned = chunks[::60]
del chunks
held = resident_bytes()
trimmed = keeper.after_job()
print(held - rest > 200 << 20, trimmed, resident_bytes() - rest < 96 << 20, keeper.after_job())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_worker_that_grew_past_its_slack_in_a_job_hands_the_memory_back_after_it():
    """The heap keeps what a job freed (mmap off, a few live blocks above it block the top's trim): after a job
    whose memory left more than the slack above the worker's resting size, malloc_trim returns it; after a job
    that did not, nothing is done (the large buffers kept for reuse stay)."""
    out = subprocess.run([sys.executable, "-c", KEEPER], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "False"], out.stdout


def test_the_worker_hands_memory_back_after_each_job():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    assert "memory.after_job()" in (root / "workers" / "worker.py").read_text()
