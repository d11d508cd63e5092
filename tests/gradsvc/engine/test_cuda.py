"""The CUDA paths: synchronised timings, the allocator's peak, OOM handling. Skipped without a GPU.

On a machine with one: `.venv/bin/pytest -q tests/gradsvc/engine/test_cuda.py` (CI has none).
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradsvc.engine import ComputeError, EngineConfig, Limits, compute
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest

from tests.support.nets import SEED_A_LAYERS, seed_a_batch, tensor_json, wide_stack_layers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda", 0)


def request(layers, x, y, dtype="float64", **options) -> GradientRequest:
    return msgspec.convert({"model": {"layers": layers, "dtype": dtype}, "inputs": tensor_json(x),
                            "targets": tensor_json(y), "options": options}, GradientRequest)


def test_cuda_gradients_equal_cpu_and_report_the_allocator_peak():
    x, y = seed_a_batch()
    req = request(SEED_A_LAYERS, x, y, numcheck="exact")
    gpu, cpu = compute(req, device=CUDA), compute(req, device=torch.device("cpu"))
    assert gpu.device.startswith("cuda")
    for name in cpu.gradients:
        a = decode(gpu.gradients[name], where=name, max_elements=1 << 30)
        b = decode(cpu.gradients[name], where=name, max_elements=1 << 30)
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name
    assert gpu.numcheck.passed and gpu.numcheck.evaluations == 166
    assert gpu.memory.device_peak_bytes and gpu.memory.device_peak_bytes > 0
    assert cpu.memory.device_peak_bytes is None
    assert gpu.timings.forward_ms > 0 and gpu.timings.backward_ms > 0


def test_wide_stack_on_cuda_saves_two_mib_per_layer():
    x = torch.randn(512, 1024)
    totals = {}
    for depth in (4, 8):
        r = compute(request(wide_stack_layers(depth), x, x, dtype="float32", numcheck="off"), device=CUDA)
        totals[depth] = (r.memory.saved_bytes_total, r.memory.device_peak_bytes)
    assert totals[8][0] - totals[4][0] == 4 * 2 * 1024 * 1024
    assert totals[8][1] > totals[4][1]


def test_cuda_oom_is_a_coded_error_and_the_next_job_runs():
    x = torch.randn(4096, 1024)
    big = request(wide_stack_layers(16), x, x, dtype="float32", numcheck="off")
    config = EngineConfig(limits=Limits(max_parameters=10**9))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(CUDA)
    # Leave this process ~64 MiB beyond what it holds now: the 16-layer stack needs far more.
    torch.cuda.set_per_process_memory_fraction(min(1.0, (total - free + (64 << 20)) / total), CUDA)
    try:
        with pytest.raises(ComputeError) as info:
            compute(big, config, device=CUDA)
        assert info.value.code == "out_of_memory"
        assert "micro_batch" in info.value.message and "checkpoint_segments" in info.value.message
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
    xs, ys = seed_a_batch()
    assert compute(request(SEED_A_LAYERS, xs, ys), device=CUDA).numcheck.passed
