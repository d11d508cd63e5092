"""A tiny CPU job runs on one intra-op thread (gradsvc.engine.compute, TINY_JOB_WORK): same answer,
the process's thread count restored afterwards, larger jobs left on every thread (but for the numerical
check's small evaluations, which gradsvc.engine.numcheck runs on one thread by a rule of its own)."""

from __future__ import annotations

import importlib

import msgspec
import pytest
import torch

from gradsvc.engine import compute
from gradsvc.wire import GradientRequest

from tests.support.nets import SEED_A_LAYERS, seed_a_batch, tensor_json, wide_stack_layers

compute_module = importlib.import_module("gradsvc.engine.compute")  # the module (the package re-exports a function of that name)
check_module = importlib.import_module("gradsvc.engine.numcheck.plan")


def request(layers, x, y, **kw) -> GradientRequest:
    body = {"model": {"layers": layers, "dtype": kw.pop("dtype", "float64"), "seed": 0},
            "inputs": tensor_json(x), "targets": tensor_json(y), **kw}
    return msgspec.convert(body, GradientRequest)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def threads_seen(req: GradientRequest):
    seen = []
    result = compute(req, progress=lambda *_: seen.append(torch.get_num_threads()))
    return result, seen


def test_a_tiny_job_runs_on_one_thread_with_the_same_answer(two_threads, monkeypatch):
    x, y = seed_a_batch(4)
    req = request(SEED_A_LAYERS, x, y)  # numcheck exact: progress is reported while it runs
    fast, seen = threads_seen(req)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(compute_module, "TINY_JOB_WORK", 0)
    monkeypatch.setattr(check_module, "SMALL_EVAL_S", 0)  # the check's own one-thread rule, off as well
    slow, seen = threads_seen(req)
    assert seen and set(seen) == {2}
    assert {k: g.data for k, g in fast.gradients.items()} == {k: g.data for k, g in slow.gradients.items()}
    # The same check, but for `reason`, which quotes the measured cost of an evaluation.
    assert msgspec.structs.replace(fast.numcheck, reason="") == msgspec.structs.replace(slow.numcheck, reason="")


def test_a_larger_job_keeps_every_thread_a_smaller_one_does_not(two_threads):
    x = torch.randn(2, 16)  # 272 parameters x 32 input elements: just above 2^13, below TINY_JOB_WORK
    _, seen = threads_seen(request(wide_stack_layers(1, 16), x, x, dtype="float32", loss="mse"))
    assert seen and set(seen) == {1}
    x = torch.randn(8, 64)  # 4160 x 512 elements: above
    _, seen = threads_seen(request(wide_stack_layers(1, 64), x, x, dtype="float32", loss="mse"))
    assert seen and set(seen) == {2}


def test_the_thread_count_is_restored_when_the_job_fails(two_threads):
    x, y = seed_a_batch(4)
    req = request(SEED_A_LAYERS, x, y)

    def boom(*_):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        compute(req, progress=boom)
    assert torch.get_num_threads() == 2
