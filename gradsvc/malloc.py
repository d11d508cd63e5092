"""Large buffers kept for reuse in the service's own processes (the API and the workers).

glibc serves every allocation above 32 MiB (its largest mmap threshold) with a fresh mmap and returns it
with munmap when freed, so each copy of a large payload (a 33.6 MB request or result: the body read
from HTTP, its decoded tensors, the encoded result) touches ~8,200 new pages: here two 33.6 MB copies
took 55-60 ms that way and 7-9 ms from reused heap memory (bench/summary.py's medium job makes about
ten such copies across the API and the worker). With mmap off, freed large blocks stay in the heap and
serve the next request; memory above 512 MiB at the heap's top is still returned to the system.
Threads' arenas still fall back to mmap for what their heaps cannot hold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("gradsvc")

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 512 << 20


def keep_large_buffers() -> bool:
    """Turns glibc's mmap of large allocations off for this process; False where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        log.debug("mallopt refused; large buffers are mmapped per allocation")
    return ok
