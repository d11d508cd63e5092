"""Large buffers kept for reuse in the service's own processes (the API and the workers).

glibc serves every allocation above 32 MiB (its largest mmap threshold) with a fresh mmap and returns it
with munmap when freed, so each copy of a large payload (a 33.6 MB request or result: the body read
from HTTP, its decoded tensors, the encoded result) touches ~8,200 new pages: here two 33.6 MB copies
took 55-60 ms that way and 7-9 ms from reused heap memory (bench/summary.py's medium job makes about
ten such copies across the API and the worker). With mmap off, freed large blocks stay in the heap and
serve the next request; memory above 512 MiB at the heap's top is still returned to the system.
A thread's arena is a heap of its own, mmapped 64 MiB at a time and unmapped when emptied, so a large
buffer allocated in a thread still gets fresh pages: the API, whose worker threads check and enqueue large
requests (a sharded request encodes its shards' bodies there: 8,200 fresh pages per 32 MB), uses the
main arena alone (`one_arena`); its threads' allocations take a lock that the GIL mostly holds anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger("gradsvc")

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 512 << 20


def keep_large_buffers(one_arena: bool = False) -> bool:
    """Turns glibc's mmap of large allocations off for this process (and, with one_arena, its threads'
    own arenas); False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if one_arena:
        ok = mallopt(M_ARENA_MAX, 1) == 1 and ok
    if not ok:
        log.debug("mallopt refused; large buffers are mmapped per allocation")
    return ok


# Room above a job's own bytes for what a running job allocates besides its tensors (encoded results, the
# freed heap glibc keeps under TRIM_THRESHOLD_BYTES, threads' stacks).
HEAP_SLACK_BYTES = 256 << 20


def data_bytes() -> int:
    """This process's data segment and private writable mappings now (VmData: what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def cap_data(job_bytes: int) -> int | None:
    """Caps this process's data (RLIMIT_DATA) at what it holds now plus `job_bytes` and HEAP_SLACK_BYTES: a
    job allocating more gets a failed allocation (torch: "can't allocate memory", a MemoryError) instead of
    taking the host's memory. The limit set, or None where there is no /proc or no RLIMIT_DATA."""
    try:
        import resource

        limit = data_bytes() + job_bytes + HEAP_SLACK_BYTES
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        return limit
    except (ImportError, OSError, ValueError, AttributeError) as exc:
        log.warning("cannot cap this process's memory (%s); GRADSVC_MAX_JOB_BYTES is checked before the queue only",
                    exc)
        return None


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS), 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemoryKeeper:
    """Hands a job's freed memory back to the system once the worker no longer needs it: glibc keeps freed heap
    for reuse (up to TRIM_THRESHOLD_BYTES at the top, and anything below a block still in use), which is what
    keep_large_buffers wants while jobs keep coming (a training loop's steps reuse the same buffers: handing
    them back after each step made a 23M GPT-2 step's forward and backward 20-30% slower, every page faulted in
    again), but one large job (a curvature run's basis) would leave the worker holding gigabytes for good.
    malloc_trim(0) returns every free page, wherever it lies in the heap.

    The excess is the process's resident size above its resting size (at its first look, after warm-up) and
    what it holds on purpose (`held()`: the models, sessions and pieces it keeps in host memory). A job that
    leaves more than `slack_bytes` of excess has it handed back when the worker has run no job for `idle_s`
    (when_idle, from the heartbeat thread), or at once after the job when the excess is over `at_once_bytes`."""

    def __init__(self, slack_bytes: int = TRIM_THRESHOLD_BYTES, idle_s: float = 5.0,
                 at_once_bytes: int = 4 * TRIM_THRESHOLD_BYTES, held: Callable[[], int] = lambda: 0) -> None:
        self.slack_bytes, self.idle_s, self.at_once_bytes, self.held = slack_bytes, idle_s, at_once_bytes, held
        self.resting_bytes = resident_bytes()
        self.due_since: float | None = None  # when the last job that left an excess ended
        try:
            self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to trim
            self._trim = None

    def excess_bytes(self) -> int:
        return resident_bytes() - self.resting_bytes - self.held()

    def after_job(self) -> bool:
        """Whether it trimmed now (an excess over at_once_bytes); an excess over the slack is left for when_idle."""
        if self._trim is None:
            return False
        excess = self.excess_bytes()
        if excess <= self.slack_bytes:
            self.due_since = None
            return False
        if excess > self.at_once_bytes:
            return self._trim_now()
        self.due_since = time.monotonic()
        return False

    def when_idle(self) -> bool:
        """Whether it trimmed: the last job left an excess and no job has ended for idle_s since (the caller
        calls it while no job runs)."""
        since = self.due_since
        if since is None or time.monotonic() - since < self.idle_s:
            return False
        return self._trim_now()

    def _trim_now(self) -> bool:
        self.due_since = None
        self._trim(0)
        return True
