"""A run's step as the worker computes it (workers/run_steps.py), against torch on the same tensors: the global and
per-module gradient norms, the update ratio per module, and what a step keeps of the weights for the next one; on a
private Redis, the previous step's weights whichever worker recorded it (a worker's own copy while Redis holds its
token, else the Redis copy), and a failed job's read in flight leaving nothing for a later command."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from torch import nn

from gradsvc.broker import keys
from gradsvc.broker.runs import RunBounds, RunStore
from gradsvc.engine import tensors
from gradsvc.wire import GradientRequest, GradientResult, Numcheck, RunCheck, RunStep, Tensor, Timings
from workers.run_steps import (TOKEN_SIZE, StepRecorder, gradient_norms, module_of, step_of, stored_weights,
                               update_ratios, weights_cache)


def test_module_of_is_the_parent_path_and_a_root_parameter_is_its_own_module():
    assert module_of("0.weight") == "0"
    assert module_of("blocks.1.attn.in_proj_weight") == "blocks.1.attn"
    assert module_of("pos") == "pos"


def test_gradient_norms_are_torchs_clip_grad_norm_total_and_each_modules_norm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    model(torch.randn(3, 5)).sum().backward()
    grads = {n: p.grad.double().flatten().numpy() for n, p in model.named_parameters()}
    total, modules = gradient_norms(grads)
    assert total == pytest.approx(float(nn.utils.clip_grad_norm_(model.parameters(), float("inf"))), rel=1e-6)
    for index in ("0", "2"):
        layer = model[int(index)]
        want = torch.cat([layer.weight.grad.flatten(), layer.bias.grad.flatten()]).double().norm()
        assert modules[index] == pytest.approx(float(want), rel=1e-12)


def test_update_ratio_is_the_modules_step_size_over_its_previous_weights_after_an_optimizer_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(8, 4)).pow(2).mean().backward()
    torch.optim.Adam(model.parameters(), lr=0.01).step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    ratios = update_ratios({n: w.double().flatten().numpy() for n, w in before.items()},
                           {n: w.double().flatten().numpy() for n, w in after.items()})
    for index in ("0", "2"):
        names = [f"{index}.weight", f"{index}.bias"]
        moved = torch.cat([(after[n] - before[n]).flatten() for n in names]).double().norm()
        size = torch.cat([before[n].flatten() for n in names]).double().norm()
        assert ratios[index] == pytest.approx(float(moved / size), rel=1e-12)


def _request(weights: dict[str, torch.Tensor]) -> GradientRequest:
    return msgspec.convert({"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}],
                                      "weights": {n: msgspec.to_builtins(tensors.encode(w))
                                                  for n, w in weights.items()}},
                            "inputs": [[0.0, 1.0]], "run": {"name": "exp", "step": 3}}, GradientRequest)


class DiagnosedResult(GradientResult):
    """A result as the diagnostics options make it (options.diagnostics, options.clip)."""

    diagnostics: dict | None = None
    clip: dict | None = None


def _result(cls=GradientResult, **extra) -> GradientResult:
    grads = {"0.weight": torch.tensor([[3.0, 0.0], [0.0, 0.0]]), "0.bias": torch.tensor([0.0, 4.0])}
    return cls(device="cpu", dtype="float32", parameter_count=6, torch_version="", loss=0.5,
               gradients={n: tensors.encode(g) for n, g in grads.items()}, timings=Timings(total_ms=2.0), **extra)


def test_a_step_compares_its_weights_with_the_previous_steps_and_keeps_its_own_for_the_next():
    w0 = {"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2)}
    w1 = {"0.weight": torch.full((2, 2), 1.5), "0.bias": torch.ones(2)}
    first, kept = step_of(_request(w0), _result(), "job-0", None, RunBounds())
    assert first.update_ratio is None and first.grad_norm == 5.0 and first.module_grad_norms == {"0": 5.0}
    assert first.step == 3 and first.loss == 0.5 and first.total_ms == 2.0
    moved = torch.cat([(w1[n] - w0[n]).flatten() for n in w0]).double().norm()
    want = float(moved / torch.cat([w0[n].flatten() for n in w0]).double().norm())  # sqrt(3) / 2
    # against the worker's own copy of the weights, and against what Redis keeps of them (another worker's read)
    for previous in (kept.flat, stored_weights(kept.stored)):
        second, _ = step_of(_request(w1), _result(), "job-1", previous, RunBounds())
        assert second.update_ratio == {"0": pytest.approx(want, rel=1e-12)}


def test_a_model_over_the_weights_bound_keeps_no_weights_and_records_no_ratio():
    w = {"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2)}
    bounds = RunBounds(weights_max_bytes=23)  # the model takes 24
    _, kept = step_of(_request(w), _result(), "job-0", None, bounds)
    assert kept is None


def test_noise_scale_and_clip_are_recorded_when_the_result_carries_them():
    plain, _ = step_of(_request({}), _result(), "job-0", None, RunBounds())
    assert plain.noise_scale is None and plain.clip is None
    result = _result(DiagnosedResult, diagnostics={"noise_scale": {"b_simple": 12.5}},
                     clip={"total_norm": 5.0, "scale": 0.2})
    diagnosed, _ = step_of(_request({}), result, "job-0", None, RunBounds())
    assert diagnosed.noise_scale == 12.5 and diagnosed.clip == {"total_norm": 5.0, "scale": 0.2}


def _reference_squares(arrays: dict[str, np.ndarray]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, a in arrays.items():
        out[module_of(name)] = out.get(module_of(name), 0.0) + float(np.dot(a, a))
    return out


def test_norms_and_ratios_in_one_pass_match_a_tensor_by_tensor_sum_whatever_the_parameters_order():
    rng = np.random.default_rng(0)
    # a module's parameters apart, an empty parameter, a root parameter
    shapes = {"0.weight": 12, "1.weight": 5, "0.bias": 3, "2.weight": 0, "pos": 4}
    before = {n: rng.standard_normal(k) for n, k in shapes.items()}
    after = {n: w + 0.01 * rng.standard_normal(w.size) for n, w in before.items()}
    total, modules = gradient_norms(before)
    want = _reference_squares(before)
    assert list(modules) == ["0", "1", "2", "pos"] and modules["2"] == 0.0
    assert modules == {m: pytest.approx(np.sqrt(s), rel=1e-12) for m, s in want.items()}
    assert total == pytest.approx(np.sqrt(sum(want.values())), rel=1e-12)
    moved = _reference_squares({n: after[n] - before[n] for n in shapes})
    assert update_ratios(before, after) == {m: pytest.approx(np.sqrt(moved[m] / want[m]), rel=1e-12)
                                            for m in ("0", "1", "pos")}  # "2" has no weight to compare with


def test_update_ratios_compare_only_the_parameters_both_steps_carry_with_the_same_size():
    before = {"0.weight": np.ones(4), "0.bias": np.ones(2), "1.weight": np.ones(3)}
    after = {"0.weight": np.full(4, 2.0), "0.bias": np.ones(5), "2.weight": np.ones(3)}  # bias resized
    assert update_ratios(before, after) == {"0": pytest.approx(1.0, rel=1e-12)}


@pytest.fixture()
def r(flushed_redis):
    return flushed_redis


def _want_ratio(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    moved = torch.cat([(after[n] - before[n]).flatten() for n in before]).double().norm()
    return float(moved / torch.cat([before[n].flatten() for n in before]).double().norm())


def _weights(k: int) -> dict[str, torch.Tensor]:
    return {"0.weight": torch.full((2, 2), 1.0 + k), "0.bias": torch.full((2,), 0.5 * k)}


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_each_step_compares_with_the_previous_whichever_worker_recorded_it(r, workers):
    # one worker reads its own copy; with several, each step follows another worker's: the Redis copy
    ws = [_weights(k) for k in range(4)]
    caches = [weights_cache() for _ in range(workers)]
    steps = [_steps_one(r, ws[k], caches[k % workers], k) for k in range(4)]
    assert steps[0].update_ratio is None
    for k in range(1, 4):
        assert steps[k].update_ratio == {"0": pytest.approx(_want_ratio(ws[k - 1], ws[k]), rel=1e-12)}
    if workers == 1:
        assert caches[0].hits == 3  # steps 1-3 read the token alone
    last = caches[3 % workers].get(("alice", "exp"))  # the last step's worker keeps what Redis keeps
    assert last.token == r.getrange(keys.run_key("test", "alice", "exp", "weights"), 0, TOKEN_SIZE - 1)


def _steps_one(r, w: dict[str, torch.Tensor], cache, k: int) -> RunStep:
    recorder = StepRecorder(r, "test", RunBounds(), "alice", f"job-{k}", _request(w), cache)
    recorder.finish(_result())(r)
    return RunStore(r, "test").steps("alice", "exp")[-1]


def test_a_worker_whose_copy_is_stale_reads_the_weights_another_worker_recorded_since(r):
    a, b = weights_cache(), weights_cache()
    ws = [_weights(k) for k in range(3)]
    _steps_one(r, ws[0], a, 0)  # a keeps step 0's weights
    _steps_one(r, ws[1], b, 1)  # b records step 1: Redis holds its weights and token
    third = _steps_one(r, ws[2], a, 2)  # a's copy is step 0's: it must not compare with it
    assert a.hits == 1 and third.update_ratio == {"0": pytest.approx(_want_ratio(ws[1], ws[2]), rel=1e-12)}
    assert third.update_ratio != {"0": pytest.approx(_want_ratio(ws[0], ws[2]), rel=1e-6)}


def test_a_step_without_weights_leaves_no_copy_and_the_next_step_records_no_ratio(r):
    cache = weights_cache()
    _steps_one(r, _weights(0), cache, 0)
    _steps_one(r, {}, cache, 1)
    assert len(cache) == 0
    assert _steps_one(r, _weights(2), cache, 2).update_ratio is None


def test_weights_an_older_version_kept_without_a_token_are_read(r):
    w0, w1 = _weights(0), _weights(1)
    older = msgspec.msgpack.encode({n: tensors.encode(t) for n, t in w0.items()})
    r.set(keys.run_key("test", "alice", "exp", "weights"), older)
    step = _steps_one(r, w1, weights_cache(), 1)
    assert step.update_ratio == {"0": pytest.approx(_want_ratio(w0, w1), rel=1e-12)}


def test_an_abandoned_step_leaves_no_reply_for_a_later_command_to_read(r):
    _steps_one(r, _weights(0), None, 0)
    for cache in (None, weights_cache()):
        StepRecorder(r, "test", RunBounds(), "alice", "job-x", _request(_weights(1)), cache).abandon()
        assert r.get("absent") is None and r.set("k", b"v") and r.get("k") == b"v"
    step = _steps_one(r, _weights(1), None, 1)
    assert step.update_ratio == {"0": pytest.approx(_want_ratio(_weights(0), _weights(1)), rel=1e-12)}


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("float16", "float16"), ("float16", "bfloat16"),
                                    ("float32", "float64")])
def test_the_redis_copy_of_the_weights_holds_exactly_what_the_step_compared(dtypes):
    torch.manual_seed(0)
    w = {"0.weight": torch.randn(3, 2).to(getattr(torch, dtypes[0])),
         "0.bias": torch.randn(3).to(getattr(torch, dtypes[1]))}
    request = _request(w)
    if dtypes[1] == "float64":  # JSON's nested lists as well as raw bytes
        request.model.weights["0.bias"] = Tensor(dtype="float64", shape=[3], data=w["0.bias"].tolist())
    _, kept = step_of(request, _result(), "job-0", None, RunBounds())
    again = stored_weights(kept.stored)
    assert again.names == kept.flat.names and again.sizes == kept.flat.sizes
    assert np.array_equal(again.vector, kept.flat.vector)
    assert np.array_equal(kept.flat.vector, torch.cat([w[n].double().flatten() for n in again.names]).numpy())


def test_a_worker_reads_whole_the_weights_of_a_run_other_workers_step_too_until_it_steps_it_alone(r):
    a, b = weights_cache(), weights_cache()
    ws = [_weights(k) for k in range(5)]
    steps = [_steps_one(r, ws[k], cache, k) for k, cache in enumerate((a, b, a, a, a))]
    for k in range(1, 5):
        assert steps[k].update_ratio == {"0": pytest.approx(_want_ratio(ws[k - 1], ws[k]), rel=1e-12)}
    # step 2 probed the token (a's copy was step 0's), step 3 read whole and found a's own token, step 4 probed
    assert a.hits == 3 and not a.get(("alice", "exp")).shared


def test_a_worker_that_found_another_workers_step_reads_the_runs_next_weights_whole(r):
    a, b = weights_cache(), weights_cache()
    _steps_one(r, _weights(0), a, 0)
    _steps_one(r, _weights(1), b, 1)
    _steps_one(r, _weights(2), a, 2)
    assert a.get(("alice", "exp")).shared  # its next step on a reads the weights whole
    recorder = StepRecorder(r, "test", RunBounds(), "alice", "job-3", _request(_weights(3)), a)
    assert not recorder.probe
    recorder.abandon()


def test_a_step_whose_check_did_not_run_records_no_verdict():
    off = Numcheck(mode="off", eps=0.0, dtype="float64", evaluations=0, max_abs_error=0.0, max_rel_error=0.0,
                   passed=None, tolerance=0.0, per_parameter={})
    step, _ = step_of(_request({}), _result(numcheck=off), "job-0", None, RunBounds())
    assert step.numcheck == RunCheck("off", None, 0.0)
    assert msgspec.json.decode(msgspec.json.encode(step))["numcheck"]["passed"] is None
