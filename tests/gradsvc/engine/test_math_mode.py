"""The float32 math a job runs in (options.math_mode, GRADSVC_FLOAT32_MATH): "ieee" unless asked, set per job and
restored after, said in the result, and the returned gradients' tolerance following the arithmetic that ran:
TF32's 10-bit mantissa where it did. TF32 itself needs a GPU; here it is simulated by rounding the operands of
every convolution and matmul (forward and backward) to a 10-bit mantissa."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsvc.engine import Engine, EngineConfig, compute
from gradsvc.engine.devices import backend_flags, float32_math, math_mode_for
from gradsvc.engine.numcheck.reference import Reference
from gradsvc.engine.numcheck.tolerances import TF32_EPS, returned_check, returned_tolerance
from gradsvc.engine.tensors import decode
from gradsvc.runtime.settings import Settings, SettingsError
from gradsvc.wire import GradientRequest

from tests.support.nets import BN_CNN_LAYERS, bn_cnn_batch, tensor_json

CPU = torch.device("cpu")
aten = torch.ops.aten


def cnn_request(**options) -> GradientRequest:
    x, y = bn_cnn_batch()
    return msgspec.convert({"model": {"layers": BN_CNN_LAYERS, "dtype": "float32"}, "inputs": tensor_json(x),
                            "targets": tensor_json(y), "loss": "cross_entropy", "options": options}, GradientRequest)


def to_tf32(t):
    """`t` with each float32 value rounded to the nearest of a 10-bit mantissa, as TF32 reads it."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        return t
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


class SimulatedTF32(TorchDispatchMode):
    """Every convolution and matmul, forward and backward, reads its float32 operands as TF32 does."""

    OPERANDS = {aten.convolution.default: (0, 1), aten.convolution_backward.default: (0, 1, 2),
                aten.mm.default: (0, 1), aten.addmm.default: (1, 2), aten.bmm.default: (0, 1)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        which = self.OPERANDS.get(func, ())
        args = tuple(to_tf32(a) if k in which else a for k, a in enumerate(args))
        return func(*args, **(kwargs or {}))


def test_the_bn_cnn_passes_the_check_in_float32_under_the_default_ieee_math():
    result = compute(cnn_request(numcheck="sampled"), device=CPU)
    assert result.math_mode == "ieee"
    assert result.numcheck.passed, result.numcheck
    assert result.numcheck.returned_tolerance == pytest.approx(1e-4)
    assert result.numcheck.returned_max_rel_error < 1e-4


def test_a_cpu_never_runs_tf32_and_says_ieee_when_asked_for_it():
    asked = compute(cnn_request(numcheck="sampled", math_mode="tf32"), device=CPU)
    by_setting = compute(cnn_request(numcheck="off"), EngineConfig(float32_math="tf32"), device=CPU)
    assert asked.math_mode == by_setting.math_mode == "ieee"
    assert asked.numcheck.passed and asked.numcheck.returned_tolerance == pytest.approx(1e-4)
    assert math_mode_for(CPU, "tf32") == "ieee" and math_mode_for(CPU, "ieee") == "ieee"


def test_a_tf32_gradient_passes_at_the_tf32_tolerance_and_fails_at_the_ieee_one():
    req = cnn_request(numcheck="off")
    with SimulatedTF32():
        ran = compute(req, device=CPU)
    got = {n: decode(g, where=n, max_elements=1 << 30) for n, g in ran.gradients.items()}
    prep = Engine().prepare(req, CPU)
    verdicts = {}
    for mode in ("ieee", "tf32"):
        ref = Reference(prep, req, CPU, mode)
        verdicts[mode] = returned_check(got, ref.grads, torch.float32, tolerances=ref.returned_tolerances(torch.float32),
                                        math_mode=mode)
    ieee, tf32 = verdicts["ieee"], verdicts["tf32"]
    assert not ieee.passed and "failed" in ieee.judged.values()  # the first convolution's gradient, as on a GPU
    assert ieee.max_rel_error > 1e-4
    assert tf32.passed and tf32.tolerance >= returned_tolerance(torch.float32, "tf32")
    # the same gradient computed in full float32 is far inside either tolerance
    exact = {n: decode(g, where=n, max_elements=1 << 30) for n, g in compute(req, device=CPU).gradients.items()}
    ref = Reference(prep, req, CPU, "ieee")
    assert returned_check(exact, ref.grads, torch.float32, tolerances=ref.returned_tolerances(torch.float32)).passed


def test_tolerances_by_math_mode():
    assert returned_tolerance(torch.float32, "tf32") == 16 * TF32_EPS == returned_tolerance(torch.float16)
    assert returned_tolerance(torch.float32, "ieee") == 1e-4
    assert returned_tolerance(torch.float64, "tf32") == 1e-10  # TF32 rounds float32 operands only


@pytest.mark.parametrize("mode", ["ieee", "tf32"])
def test_float32_math_sets_each_flag_for_the_job_and_restores_the_process_s(mode):
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (torch.get_float32_matmul_precision(), cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
              matmul.allow_bf16_reduced_precision_reduction)
    # the process as CUDA leaves it: cuDNN in TF32, reduced-precision reductions on
    torch.set_float32_matmul_precision("high")
    with backend_flags():  # frozen where an earlier test imported torch.testing's common_utils
        cudnn.allow_tf32 = matmul.allow_fp16_reduced_precision_reduction = True
        matmul.allow_bf16_reduced_precision_reduction = True
    try:
        # the flags are the process's: a device object is all this needs, not a GPU
        with float32_math(mode, torch.device("cuda", 0)):
            tf32 = mode == "tf32"
            assert matmul.allow_tf32 is tf32 and cudnn.allow_tf32 is tf32
            assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
            assert not matmul.allow_fp16_reduced_precision_reduction
            assert not matmul.allow_bf16_reduced_precision_reduction
        assert torch.get_float32_matmul_precision() == "high" and matmul.allow_tf32 and cudnn.allow_tf32
        assert matmul.allow_fp16_reduced_precision_reduction and matmul.allow_bf16_reduced_precision_reduction
        with float32_math(mode, CPU):  # a CPU: the matmul precision alone (oneDNN reads it)
            assert torch.get_float32_matmul_precision() == ("high" if mode == "tf32" else "highest")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before[0])
        with backend_flags():
            cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction = before[1], before[2]
            matmul.allow_bf16_reduced_precision_reduction = before[3]


def test_a_job_restores_the_process_s_math_when_it_fails():
    torch.set_float32_matmul_precision("high")
    try:
        bad = msgspec.structs.replace(cnn_request(), targets=tensor_json(torch.full((8,), 99)))
        with pytest.raises(Exception):
            compute(bad, device=CPU)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")


def test_the_setting_takes_ieee_or_tf32_only():
    assert Settings.from_env({}).float32_math == "ieee"
    assert Settings.from_env({"GRADSVC_FLOAT32_MATH": "tf32"}).float32_math == "tf32"
    with pytest.raises(SettingsError, match="GRADSVC_FLOAT32_MATH"):
        Settings.from_env({"GRADSVC_FLOAT32_MATH": "fast"})
