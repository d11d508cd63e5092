"""An allocation that fails inside a job is a coded out_of_memory, raised without the failed job's frames (and,
through them, its tensors) attached, and the next job runs. On a CPU: a tensor far past the host's memory,
refused at once by the allocator; tests/gradsvc/engine/test_cuda.py provokes a real one on a GPU."""

from __future__ import annotations

import pytest
import torch

from gradsvc.engine import ComputeError, compute

from tests.support.nets import oom_request, seed_a_body

CPU = torch.device("cpu")


def test_an_allocation_past_the_host_is_out_of_memory_with_no_frames_kept_and_the_next_job_runs():
    import msgspec

    from gradsvc.wire import GradientRequest

    req, config = oom_request(1 << 30, elements=1 << 42)  # a 16 TiB activation
    with pytest.raises(ComputeError) as info:
        compute(req, config, device=CPU)
    assert info.value.code == "out_of_memory"
    assert "micro_batch" in info.value.message
    assert info.value.__context__ is None and info.value.__cause__ is None  # no traceback of the job's frames
    assert compute(msgspec.convert(seed_a_body(), GradientRequest), device=CPU).numcheck.passed


@pytest.mark.parametrize(("said", "memory"), [
    ("CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
     "12582912 bytes. Error code 12 (Cannot allocate memory)", True),
    ("could not create a primitive", True),  # oneDNN's conv when its scratch memory cannot be allocated
    ("index 7 is out of bounds for dimension 0 with size 5", False),
])
def test_every_allocators_failure_is_read_as_memory_and_a_values_error_is_not(said, memory):
    from gradsvc.engine.devices import is_allocation_failure

    assert is_allocation_failure(RuntimeError(said)) is memory
