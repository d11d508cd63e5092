"""The CUDA paths: synchronised timings, the job's own device peak, OOM handling, the float32 math (the same
verdict as on a CPU), the gradients' one flat copy to the host and the fused finiteness check. Skipped without
a GPU.

On a machine with one: `.venv/bin/pytest -q tests/gradsvc/engine/test_cuda.py` (CI has none).
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradsvc.engine import ComputeError, EngineConfig, Limits, compute
from gradsvc.engine import tensors
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest

from tests.support.nets import (BN_CNN_LAYERS, SEED_A_LAYERS, bn_cnn_batch, oom_request, seed_a_batch, tensor_json,
                                wide_stack_layers)

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
    total = torch.cuda.get_device_properties(CUDA).total_memory
    big, config = oom_request(total)
    held = torch.cuda.memory_allocated(CUDA)
    with pytest.raises(ComputeError) as info:
        compute(big, config, device=CUDA)
    assert info.value.code == "out_of_memory"
    assert "micro_batch" in info.value.message and "checkpoint_segments" in info.value.message
    assert torch.cuda.memory_allocated(CUDA) <= held + (64 << 20)  # the failed job's tensors went with it
    xs, ys = seed_a_batch()
    assert compute(request(SEED_A_LAYERS, xs, ys), device=CUDA).numcheck.passed


@pytest.mark.parametrize("mode", ["exact", "sampled"])
def test_the_bn_cnn_in_float32_gets_the_same_verdict_on_cpu_and_cuda(mode):
    x, y = bn_cnn_batch()
    req = request(BN_CNN_LAYERS, x, y, dtype="float32", numcheck=mode)
    gpu, cpu = compute(req, device=CUDA), compute(req, device=torch.device("cpu"))
    assert gpu.math_mode == cpu.math_mode == "ieee"
    assert gpu.numcheck.passed and cpu.numcheck.passed, (gpu.numcheck, cpu.numcheck)
    assert gpu.numcheck.returned_tolerance == cpu.numcheck.returned_tolerance == pytest.approx(1e-4)
    assert gpu.numcheck.returned_max_rel_error < 1e-4


def test_tf32_runs_where_asked_and_the_device_has_it_and_is_judged_at_its_tolerance():
    x, y = bn_cnn_batch()
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    result = compute(request(BN_CNN_LAYERS, x, y, dtype="float32", numcheck="sampled", math_mode="tf32"), device=CUDA)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    has_tf32 = torch.cuda.get_device_capability(CUDA)[0] >= 8
    assert result.math_mode == ("tf32" if has_tf32 else "ieee")
    if has_tf32:
        assert result.numcheck.returned_tolerance >= 16 * 2.0 ** -10
    assert result.numcheck.passed, result.numcheck


def test_the_device_peak_is_the_job_s_own_above_what_the_worker_holds():
    held = torch.empty(256 << 20, dtype=torch.uint8, device=CUDA)  # what a worker may hold between jobs
    x, y = seed_a_batch()
    compute(request(SEED_A_LAYERS, x, y), device=CUDA)  # as a worker's warm-up: cuBLAS's workspace is the worker's
    peak = compute(request(SEED_A_LAYERS, x, y), device=CUDA).memory.device_peak_bytes
    assert 0 < peak < (4 << 20), peak  # the 83-parameter net's tensors, not the 256 MiB nor the allocator's past
    del held


def test_gradients_come_to_the_host_in_one_copy_equal_to_each_tensor_s_own():
    named = {"a": torch.randn(3, 4, device=CUDA), "b": torch.randn(5, device=CUDA, dtype=torch.float64),
             "c": torch.randn(4, 3, device=CUDA).t(), "d": torch.zeros(0, device=CUDA),
             "e": torch.randn(2, 2, device=CUDA, dtype=torch.bfloat16), "f": torch.randn(2)}
    host = tensors.to_host(named)
    for name, t in named.items():
        assert host[name].device.type == "cpu" and host[name].shape == t.shape and host[name].dtype == t.dtype
        assert torch.equal(host[name], t.cpu()), name
    assert host["a"].is_pinned()


def test_the_fused_finiteness_check_on_the_device():
    ts = [torch.randn(100, device=CUDA), torch.randn(7, device=CUDA, dtype=torch.float16)]
    assert tensors.all_finite_many(ts)
    ts[1][3] = float("nan")
    assert not tensors.all_finite_many(ts)
