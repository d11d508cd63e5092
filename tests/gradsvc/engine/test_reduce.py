"""Sharded == unsharded: the batch split into 2, 3 and 7 uneven shards, each computed by the engine as
its own request, reduced by gradsvc/engine/reduce.py, against the whole batch in one compute() (float64,
1e-12 relative). The shards are cut by service/fan_out.py, as the API cuts them (wire tensors, no torch)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradsvc.wire import GradientRequest, GradientResult
from service.fan_out import shard_requests
from gradsvc.engine import SpecError, compute, prepare
from gradsvc.engine.prepare import EngineConfig
from gradsvc.engine.reduce import check_combined, validate_shardable, plan_for, reduce_results, split_rows
from gradsvc.engine.tensors import decode, encode

from tests.support.nets import SEED_A_LAYERS, TWO_LOSSES, tensor_json

N = 23  # divides by none of 2, 3, 7
REL = 1e-12


def T(wire) -> torch.Tensor:
    return decode(wire, where="test", max_elements=1 << 40).to(torch.float64)


def batch(n: int = N, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    teacher = torch.softmax(torch.randn(n, 3, generator=g, dtype=torch.float64), 1)
    return x, y, teacher


def request(loss=None, losses=None, **options) -> GradientRequest:
    x, y, teacher = batch()
    body = {"model": {"layers": SEED_A_LAYERS, "dtype": "float64", "seed": 0}, "inputs": tensor_json(x),
            "options": {"numcheck": "off", **options}}
    if losses is not None:
        body["losses"] = losses
        body["targets"] = {"label": y.tolist(), "teacher": tensor_json(teacher)}
    else:
        body["loss"] = loss or "cross_entropy"
        body["targets"] = tensor_json(y)
    return msgspec.convert(body, GradientRequest)


def sharded(req: GradientRequest, count: int) -> GradientResult:
    prep = prepare(req, EngineConfig(), "meta")
    validate_shardable(prep, count)
    bounds = split_rows(prep.inputs.rows, count)
    plan = plan_for(prep, [b - a for a, b in bounds])
    per_loss = req.options.per_loss if plan.uniform else True
    parts = []
    for shard in shard_requests(req, prep, bounds, per_loss=per_loss):
        # Through MessagePack, as a shard job receives it.
        parts.append(compute(msgspec.msgpack.decode(msgspec.msgpack.encode(shard), type=GradientRequest)))
    return reduce_results(parts, plan)


def assert_close(a, b, what: str) -> None:
    if b is None:  # a frozen parameter
        assert a is None, what
        return
    a, b = T(a), T(b)
    assert a.shape == b.shape, what
    scale = max(float(b.abs().max()), 1e-300)
    assert float((a - b).abs().max()) / scale <= REL, (what, float((a - b).abs().max()) / scale)


def assert_same(got: GradientResult, want: GradientResult) -> None:
    assert got.loss == pytest.approx(want.loss, rel=REL, abs=0)
    for name, g in want.gradients.items():
        assert_close(got.gradients[name], g, name)
    if want.losses is not None:
        assert got.losses.keys() == want.losses.keys()
        for k, v in want.losses.items():
            assert got.losses[k] == pytest.approx(v, rel=REL, abs=0), k
    if want.per_loss_gradients is not None:
        for term, grads in want.per_loss_gradients.items():
            for name, g in grads.items():
                assert_close(got.per_loss_gradients[term][name], g, f"{term}/{name}")
        for pair, c in want.gradient_cosine.items():
            assert got.gradient_cosine[pair] == pytest.approx(c, rel=REL, abs=1e-14), pair
    else:
        assert got.per_loss_gradients is None and got.gradient_cosine is None
    assert (got.hvp is None) == (want.hvp is None)
    if want.hvp is not None:
        for name, h in want.hvp.items():
            assert_close(got.hvp[name], h, f"hvp {name}")
    assert (got.input_gradient is None) == (want.input_gradient is None)
    if want.input_gradient is not None:
        assert_close(got.input_gradient, want.input_gradient, "input_gradient")
    assert (got.per_sample is None) == (want.per_sample is None)
    if want.per_sample is not None:
        assert_close(got.per_sample.norms, want.per_sample.norms, "per_sample.norms")
        if want.per_sample.gradients is not None:
            for name, g in want.per_sample.gradients.items():
                assert_close(got.per_sample.gradients[name], g, f"per_sample {name}")


CASES = {
    "mean": dict(loss="cross_entropy"),
    "sum": dict(loss={"type": "cross_entropy", "reduction": "sum"}),
    "several_losses": dict(losses=TWO_LOSSES),
    "mixed_mean_and_sum": dict(losses=[TWO_LOSSES[0], {**TWO_LOSSES[1], "reduction": "sum"}]),
    "mixed_without_per_loss": dict(losses=[TWO_LOSSES[0], {**TWO_LOSSES[1], "reduction": "sum"}], per_loss=False),
    "hvp_input_grad": dict(loss="cross_entropy", hvp={"vector": "random", "seed": 3}, input_grad=True),
    "sum_hvp_input_grad": dict(loss={"type": "cross_entropy", "reduction": "sum"}, hvp={"vector": "random"},
                               input_grad=True),
    "several_hvp_input_grad": dict(losses=TWO_LOSSES, hvp={"vector": "random"}, input_grad=True),
    "per_sample_full": dict(loss="cross_entropy", per_sample="full"),
    "micro_batch_inside_shards": dict(losses=TWO_LOSSES, micro_batch=2),
    "frozen": dict(loss="cross_entropy", freeze=["0"]),
}


@pytest.mark.parametrize("count", [2, 3, 7])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_result_equals_the_whole_batch_in_float64(case, count):
    kw = dict(CASES[case])
    req = request(kw.pop("loss", None), kw.pop("losses", None), **kw)
    want = compute(req)
    got = sharded(req, count)
    assert_same(got, want)
    assert got.shards.count == count and got.shards.rows == [b - a for a, b in split_rows(N, count)]
    assert sum(got.shards.rows) == N


def test_split_rows_is_contiguous_and_even_larger_first():
    assert split_rows(23, 7) == [(0, 4), (4, 8), (8, 11), (11, 14), (14, 17), (17, 20), (20, 23)]
    assert split_rows(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_memory_is_the_largest_shards_and_timings_give_the_critical_path():
    req = request("cross_entropy", memory=True, numcheck="exact")
    got = sharded(req, 3)
    assert got.memory is not None and got.memory.saved_bytes_total > 0
    full = compute(req)
    assert got.memory.saved_bytes_total < full.memory.saved_bytes_total  # 8 of 23 rows
    assert got.shards.critical_path_ms == pytest.approx(max(got.shards.shard_total_ms) + got.shards.reduce_ms)
    assert got.timings.total_ms == pytest.approx(got.shards.critical_path_ms)
    assert got.shards.compute_ms == pytest.approx(sum(got.shards.shard_total_ms))
    # The reported check is the worst shard's, passed only if all passed.
    assert got.numcheck is not None and got.numcheck.passed
    assert got.shards.numcheck_shard in range(3)


def test_timings_carry_every_phase_of_the_slowest_shard():
    """prepare_ms is the slowest shard's, not left out (0.0): every shard prepared."""
    from gradsvc.wire import Timings

    req = request("cross_entropy", memory=True, numcheck="exact")
    prep = prepare(req, EngineConfig(), "meta")
    plan = plan_for(prep, [b - a for a, b in split_rows(N, 2)])
    parts = [compute(req), compute(req)]
    phases = [f for f in Timings.__struct_fields__ if f != "total_ms"]
    for k, part in enumerate(parts):  # distinct values per phase, shard 1 the slowest
        part.timings = Timings(**{f: 1.0 + i + 10 * k for i, f in enumerate(phases)}, total_ms=100.0 + k)
    got = reduce_results(parts, plan, reduce_ms=2.0)
    assert {f: getattr(got.timings, f) for f in phases} == {f: getattr(parts[1].timings, f) for f in phases}
    assert got.timings.total_ms == 103.0
    assert sharded(req, 2).timings.prepare_ms > 0


def test_batch_statistics_dropout_and_too_many_shards_are_refused_with_bad_option():
    bn = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "BatchNorm1d", "num_features": 8},
          {"type": "Linear", "in_features": 8, "out_features": 3}]
    drop = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Dropout", "p": 0.5},
            {"type": "Linear", "in_features": 8, "out_features": 3}]
    for layers, count, needle in ((bn, 2, "BatchNorm1d"), (drop, 2, "Dropout"), (SEED_A_LAYERS, N + 1, "exceeds")):
        req = msgspec.structs.replace(request(), model=msgspec.structs.replace(request().model, layers=layers))
        with pytest.raises(SpecError) as err:
            validate_shardable(prepare(req, EngineConfig(), "meta"), count)
        assert err.value.code == "bad_option" and needle in err.value.message
    mixed = request(losses=[TWO_LOSSES[0], {**TWO_LOSSES[1], "reduction": "sum"}], input_grad=True)
    with pytest.raises(SpecError) as err:
        validate_shardable(prepare(mixed, EngineConfig(), "meta"), 2)
    assert err.value.code == "bad_option" and "one reduction" in err.value.message


def test_shards_whose_check_was_off_reduce_to_a_check_that_did_not_run():
    got = sharded(request("cross_entropy", numcheck="off"), 3)
    assert got.numcheck is not None and got.numcheck.mode == "off" and got.numcheck.passed is None


def test_the_combined_check_holds_each_tensor_to_the_widest_tolerance_a_shard_gave_it():
    """A float32 job in 3 shards: each shard's check sets per-tensor tolerances from its own rows' arithmetic;
    the combined gradient is judged tensor by tensor against the widest of them (not the widest of all tensors as
    one number); a gradient off by more than its own still fails."""
    x, y, _ = batch()
    body = {"model": {"layers": SEED_A_LAYERS, "dtype": "float32", "seed": 0}, "inputs": tensor_json(x.float()),
            "targets": tensor_json(y), "loss": "cross_entropy", "options": {"numcheck": "exact"}}
    req = msgspec.convert(body, GradientRequest)
    prep = prepare(req, EngineConfig(), "meta")
    bounds = split_rows(prep.inputs.rows, 3)
    plan = plan_for(prep, [b - a for a, b in bounds])
    parts, references = [], []
    for shard in shard_requests(req, prep, bounds, per_loss=req.options.per_loss):
        reference: dict = {}
        parts.append(compute(msgspec.msgpack.decode(msgspec.msgpack.encode(shard), type=GradientRequest),
                             reference=reference))
        references.append({n: encode(t) for n, t in reference.items()})
    widest = {n: max(p.numcheck.per_parameter[n].returned_tolerance for p in parts) for n in references[0]}
    result = reduce_results(parts, plan)
    check_combined(result, references, plan, parts)
    assert result.numcheck.passed is True, result.numcheck.reason
    assert {n: p.returned_tolerance for n, p in result.numcheck.per_parameter.items()} == widest

    # one shard's arithmetic widened one tensor's tolerance: that tensor gets it, the others keep theirs
    size = {n: float(T(g).abs().max()) for n, g in result.gradients.items() if n in widest}
    first = max(size, key=size.get)  # the largest gradient: a planted error is not under the floor of the scale
    second = next(n for n in widest if n != first)
    parts[1].numcheck.per_parameter[first].returned_tolerance = 0.2
    for name, passed in ((first, True), (second, False)):
        off = reduce_results(parts, plan)
        off.gradients[name] = encode(T(off.gradients[name]).float() * 1.1)
        check_combined(off, references, plan, parts)
        assert off.numcheck.passed is passed, (name, off.numcheck.per_parameter[name])
    wrong = reduce_results(parts, plan)
    wrong.gradients[first] = encode(T(wrong.gradients[first]).float() * 1.5)
    check_combined(wrong, references, plan, parts)
    assert wrong.numcheck.passed is False and wrong.numcheck.per_parameter[first].returned_judged == "failed"
