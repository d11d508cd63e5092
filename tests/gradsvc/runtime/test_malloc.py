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
import sys, time
from gradsvc.runtime.malloc import MemoryKeeper, keep_large_buffers, resident_bytes
assert keep_large_buffers()
held = [0]
keeper = MemoryKeeper(slack_bytes=64 << 20, idle_s=0.3, at_once_bytes=int(sys.argv[1]) << 20, held=lambda: held[0])
rest = resident_bytes()

def leave(mb):
    chunks = [bytearray(b"x" * (1 << 20)) for _ in range(mb)]  # a job's buffers, freed but for a few
    pinned = chunks[::60]
    del chunks
    return pinned

out = []
pinned = leave(300)
left = resident_bytes() - rest
out.append(left > 200 << 20)
held[0] = left  # all of it held on purpose (a resident model): no job's leftovers
out += [keeper.after_job(), keeper.when_idle()]
held[0] = 0
out.append(keeper.after_job())   # 300 MB over the slack: at once only past at_once_bytes
out.append(keeper.when_idle())   # not yet idle for idle_s
time.sleep(0.4)
out += [keeper.when_idle(), resident_bytes() - rest < 96 << 20, keeper.when_idle()]
print(*out)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
@pytest.mark.parametrize("at_once_mb, expected", [
    (4096, "True False False False False True True False"),  # handed back once the worker was idle 0.3 s
    (128, "True False False True False False True False"),   # over at_once_bytes: handed back after the job
])
def test_a_jobs_leftover_heap_is_handed_back_when_the_worker_idles_or_at_once_past_a_bound(at_once_mb, expected):
    """The heap keeps what a job freed (mmap off, a few live blocks above it block the top's trim). What the
    worker holds on purpose is not a leftover; a leftover over the slack is handed back (malloc_trim) once the
    worker has run no job for idle_s, so back-to-back jobs reuse it, or right after the job past at_once_bytes."""
    out = subprocess.run([sys.executable, "-c", KEEPER, str(at_once_mb)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == expected.split(), out.stdout
