"""options.curvature with options.shards: the request cut as the API cuts it (service/fan_out.py: the row shards,
then the Lanczos jobs over the whole batch), each job computed by the engine as a worker computes it, reduced by
gradsvc/engine/reduce.py, against the same request in one job for the same seed (float64): the top eigenvalues
and the density from the Lanczos jobs, the Hutchinson trace summed from the row shards' per-probe samples."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradsvc.engine import EngineConfig, SpecError, compute, prepare
from gradsvc.engine.reduce import reduce_results
from gradsvc.wire import CurvatureOptions, GradientRequest, GradientResult
from service.fan_out import split

from tests.support.nets import SEED_A_LAYERS, TWO_LOSSES, tensor_json

N = 11  # divides by neither 2 nor 3
CNN_LAYERS = [{"type": "Conv2d", "in_channels": 2, "out_channels": 3, "kernel_size": 3},
              {"type": "ReLU"}, {"type": "Flatten"}, {"type": "Linear", "in_features": 12, "out_features": 3}]
MODELS = {"mlp": (SEED_A_LAYERS, (6,)), "cnn": (CNN_LAYERS, (2, 4, 4))}
LANCZOS = {"top": 3, "trace": True, "density": True, "probes": 5, "iterations": 12, "tolerance": 1e-8, "seed": 4,
           "eigenvectors": True}
HUTCHINSON = {"top": 2, "trace": True, "probes": 30, "tolerance": 1e-8, "seed": 9}


def body(model: str, reduction: str = "mean", **options) -> dict:
    """A POST /gradients body: the float64 MLP or CNN over N rows, cross entropy."""
    layers, shape = MODELS[model]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    return {"model": {"layers": layers, "dtype": "float64", "seed": 0}, "inputs": tensor_json(x),
            "targets": tensor_json(y), "loss": {"type": "cross_entropy", "reduction": reduction},
            "options": {"numcheck": "off", **options}}


def request(model: str, reduction: str = "mean", **options) -> GradientRequest:
    return msgspec.convert(body(model, reduction, **options), GradientRequest)


def through_msgpack(body: bytes) -> GradientRequest:
    return msgspec.msgpack.decode(body, type=GradientRequest)


def sharded(req: GradientRequest, count: int) -> tuple[GradientResult, list[GradientRequest]]:
    cut = split(req, prepare(req, EngineConfig(), "meta"), count)
    jobs = [through_msgpack(b) for b in cut.bodies]  # as each shard job receives its body
    return reduce_results([compute(j) for j in jobs], cut.plan), jobs


def assert_same_curvature(got, want) -> None:
    assert got.matrix == want.matrix and got.products == want.products
    assert got.top_eigenvalues == pytest.approx(want.top_eigenvalues, rel=1e-9)
    assert got.residuals == pytest.approx(want.residuals, rel=1e-6, abs=1e-12)
    if want.trace is not None:
        assert got.trace == pytest.approx(want.trace, rel=1e-10)
        assert got.trace_stderr == pytest.approx(want.trace_stderr, rel=1e-8)
        assert got.trace_samples == pytest.approx(want.trace_samples, rel=1e-10)
    assert (got.density is None) == (want.density is None)
    if want.density is not None:
        assert got.density.eigenvalues == pytest.approx(want.density.eigenvalues, rel=1e-12, abs=1e-14)
        assert got.density.weights == pytest.approx(want.density.weights, rel=1e-12)
    assert (got.eigenvectors is None) == (want.eigenvectors is None)
    for g, w in zip(got.eigenvectors or [], want.eigenvectors or []):
        for name in w:
            assert torch.equal(msgspec_tensor(g[name]), msgspec_tensor(w[name])), name


def msgspec_tensor(wire) -> torch.Tensor:
    from gradsvc.engine.tensors import decode

    return decode(wire, where="test", max_elements=1 << 30)


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("matrix", ["hessian", "ggn"])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_lanczos_parts_equal_one_job_for_the_same_seed(model, matrix, count):
    req = request(model, curvature={**LANCZOS, "matrix": matrix})
    want = compute(req).curvature
    got, jobs = sharded(req, count)
    assert_same_curvature(got.curvature, want)
    assert sum(w for w in got.curvature.density.weights) == pytest.approx(1.0, abs=1e-12)
    # the density's 5 probes spread over `count` whole-batch jobs; the row shards compute no curvature
    assert [j.options.curvature for j in jobs[:count]] == [None] * count
    lanczos = [j.options.curvature for j in jobs[count:]]
    assert [c.probes for c in lanczos] == ([3, 2] if count == 2 else [2, 2, 1])
    assert [c.top for c in lanczos] == [3] + [0] * (count - 1)
    assert got.shards.count == count and got.shards.curvature_jobs == count
    assert len(got.shards.shard_total_ms) == 2 * count


@pytest.mark.parametrize("reduction, count", [("mean", 2), ("sum", 3)])
@pytest.mark.parametrize("matrix", ["hessian", "ggn"])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_trace_is_the_row_shards_samples_summed_and_equals_one_job(model, matrix, reduction, count):
    req = request(model, reduction, curvature={**HUTCHINSON, "matrix": matrix})
    want = compute(req).curvature
    got, jobs = sharded(req, count)
    assert_same_curvature(got.curvature, want)
    rows = [j.options.curvature for j in jobs[:count]]
    assert all(c == CurvatureOptions(matrix=matrix, top=0, trace=True, probes=30, seed=9) for c in rows)
    assert len(jobs) == count + 1 and jobs[-1].options.curvature.trace is False  # the top's one Lanczos job


def test_trace_alone_runs_on_the_row_shards_only():
    req = request("mlp", curvature={"top": 0, "trace": True, "probes": 20})
    got, jobs = sharded(req, 3)
    assert len(jobs) == 3 and got.shards.curvature_jobs == 0
    assert_same_curvature(got.curvature, compute(req).curvature)


def test_gradients_and_loss_stay_those_of_the_row_shards():
    req = request("cnn", curvature=LANCZOS)
    whole = compute(req)
    got, _ = sharded(req, 2)
    assert got.loss == pytest.approx(whole.loss, rel=1e-12)
    for name, g in whole.gradients.items():
        assert torch.allclose(msgspec_tensor(got.gradients[name]), msgspec_tensor(g), rtol=1e-12, atol=1e-15)


def test_first_probe_picks_a_range_of_one_seeds_probes():
    base = {"top": 0, "trace": True, "density": True, "probes": 6, "iterations": 8, "seed": 2}
    whole = compute(request("mlp", curvature=base)).curvature
    head = compute(request("mlp", curvature={**base, "probes": 2})).curvature
    tail = compute(request("mlp", curvature={**base, "probes": 4, "first_probe": 2})).curvature
    assert head.trace_samples + tail.trace_samples == whole.trace_samples
    assert head.density.eigenvalues + tail.density.eigenvalues == whole.density.eigenvalues


def test_mixed_reductions_with_sharded_curvature_are_refused_with_bad_option():
    body = msgspec.to_builtins(request("mlp", curvature={"top": 1}, shards=2))
    g = torch.Generator().manual_seed(1)
    body["targets"] = {"label": body.pop("targets"), "teacher": tensor_json(torch.rand(N, 3, generator=g,
                                                                                         dtype=torch.float64))}
    body.pop("loss")
    body["losses"] = [TWO_LOSSES[0], {**TWO_LOSSES[1], "reduction": "sum"}]
    req = msgspec.convert(body, GradientRequest)
    with pytest.raises(SpecError) as info:
        split(req, prepare(req, EngineConfig(), "meta"), 2)
    assert info.value.code == "bad_option" and "one reduction or shards=1" in info.value.message


def test_diagnostics_and_clipping_across_shards_stay_refused_while_curvature_is_accepted():
    with pytest.raises(SpecError) as info:
        prepare(request("mlp", curvature={"top": 1}, diagnostics=["norms"], shards=2), EngineConfig(), "meta")
    assert info.value.code == "bad_option" and "options.diagnostics" in info.value.message
    prepare(request("mlp", curvature={"top": 1}, shards=2), EngineConfig(), "meta")
