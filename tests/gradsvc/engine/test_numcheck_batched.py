"""The numerical check's batched evaluations (batched_losses.batched: torch.func.vmap over functional_call) give
the sequential loop's figures: the same perturbed values, the same evaluation counts, losses within a few
float64 roundings (vmap's batched kernels round differently), hence finite differences within a fraction
of the check's own rounding floor. And every case it cannot take falls back to the loop."""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch

from gradsvc.engine import EngineConfig, compute
from gradsvc.engine.numcheck import batched as batched_losses
from gradsvc.engine.numcheck import tolerances
from gradsvc.engine.numcheck.run import CheckRun, run
from gradsvc.engine.prepare import prepare
from gradsvc.wire import GradientRequest

from tests.support.nets import SEED_A_LAYERS, seed_a_batch, seed_a_module, tensor_json

EPS = 1e-6


def _batch(seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    x, y = seed_a_batch(5)
    return g, x, y


def _nets():
    """name -> (layers, inputs, loss or losses, targets)."""
    g, x, y = _batch()
    soft = torch.softmax(torch.randn(5, 3, generator=g, dtype=torch.float64), 1)
    reg = torch.randn(5, 3, generator=g, dtype=torch.float64)
    seq = torch.randn(5, 2, 6, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 10, (5, 4), generator=g)
    mlp = [{"type": "Linear", "in_features": 6, "out_features": 16}, {"type": "Tanh"},
           {"type": "Linear", "in_features": 16, "out_features": 16}, {"type": "ReLU"},
           {"type": "Linear", "in_features": 16, "out_features": 3}]
    return {
        "seed_a": (SEED_A_LAYERS, x, "cross_entropy", y),
        "mlp_relu": (mlp, x, "cross_entropy", y),
        "conv_gelu": ([{"type": "Conv1d", "in_channels": 2, "out_channels": 3, "kernel_size": 3}, {"type": "GELU"},
                       {"type": "Flatten"}, {"type": "Linear", "in_features": 12, "out_features": 3}], seq,
                      "cross_entropy", y),
        "layernorm_residual": ([{"type": "Linear", "in_features": 6, "out_features": 8},
                                {"type": "LayerNorm", "normalized_shape": 8},
                                {"type": "Residual", "layers": [{"type": "Linear", "in_features": 8, "out_features": 8},
                                                                {"type": "SiLU"}]},
                                {"type": "Linear", "in_features": 8, "out_features": 3}], x, "cross_entropy", y),
        "embedding": ([{"type": "Embedding", "num_embeddings": 10, "embedding_dim": 3}, {"type": "Flatten"},
                       {"type": "Linear", "in_features": 12, "out_features": 3}], tokens, "cross_entropy", y),
        "soft_targets": (SEED_A_LAYERS, x, "cross_entropy", soft),
        "nll": (SEED_A_LAYERS + [{"type": "LogSoftmax", "dim": 1}], x, "nll", y),
        "mse_sum": (SEED_A_LAYERS, x, {"type": "mse", "reduction": "sum"}, reg),
        "huber": (SEED_A_LAYERS, x, "huber", reg),
        "smooth_l1": (SEED_A_LAYERS, x, "smooth_l1", reg),
        "l1": (SEED_A_LAYERS, x, "l1", reg),
        "bce_with_logits": (SEED_A_LAYERS, x, "bce_with_logits", soft),
        "bce": (SEED_A_LAYERS + [{"type": "Sigmoid"}], x, "bce", soft),
        "two_losses": (SEED_A_LAYERS, x, [{"type": "cross_entropy", "name": "ce", "target": "label"},
                                          {"type": "mse", "name": "reg", "target": "reg", "weight": 0.25,
                                           "reduction": "sum"}], {"label": y, "reg": reg}),
    }


NETS = _nets()


def _request(net: str, **options) -> GradientRequest:
    layers, x, loss, y = NETS[net]
    body = {"model": {"layers": layers, "dtype": "float64", "seed": 0}, "inputs": tensor_json(x),
            "options": {"memory": False, **options}}
    if isinstance(loss, list):
        body["losses"], body["targets"] = loss, {k: tensor_json(v) for k, v in y.items()}
    else:
        body["loss"], body["targets"] = loss, tensor_json(y)
    return msgspec.convert(body, GradientRequest)


@pytest.fixture
def batched_calls(monkeypatch):
    """Counts the batched calls compute() makes (batched_losses.batched wrapped)."""
    calls = []
    real = batched_losses.batched

    def spy(*args, **kwargs):
        b = real(*args, **kwargs)

        def losses(perturbed):
            calls.append(next(iter(perturbed.values())).shape[0])
            return b.losses(perturbed)
        return batched_losses.Batched(losses, b.row_elements)

    monkeypatch.setattr(batched_losses, "batched", spy)
    return calls


def _sequential(req: GradientRequest, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(batched_losses, "batchable", lambda *a, **k: False)
        return compute(req, EngineConfig()).numcheck


# --- the figures, through compute() -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "sampled", "directional"])
@pytest.mark.parametrize("net", sorted(NETS))
def test_batched_check_gives_the_sequential_figures(net, mode, batched_calls, monkeypatch):
    req = _request(net, numcheck=mode, numcheck_samples=3)
    got = compute(req, EngineConfig()).numcheck
    assert batched_calls, "the check did not batch"
    assert sum(batched_calls) == got.evaluations
    ref = _sequential(req, monkeypatch)
    assert got.evaluations == ref.evaluations
    assert got.passed and ref.passed and got.max_rel_error < 1e-6
    assert {n: c.checked for n, c in got.per_parameter.items()} == {n: c.checked for n, c in ref.per_parameter.items()}
    # Losses within a few roundings: the differences move by under a quarter of the rounding floor (8 roundings).
    assert got.rounding_floor == pytest.approx(ref.rounding_floor, rel=1e-14)
    for name, c in got.per_parameter.items():
        assert abs(c.max_abs_error - ref.per_parameter[name].max_abs_error) <= ref.rounding_floor / 4, name
        assert c.returned_max_rel_error == ref.per_parameter[name].returned_max_rel_error
    assert got.returned_max_rel_error == ref.returned_max_rel_error


def test_seed_a_counts_each_perturbed_loss_and_batches_in_one_call(batched_calls):
    from tests.support.nets import seed_a_body

    for mode, evaluations in (("exact", 166), ("sampled", 54), ("auto", 166)):
        batched_calls.clear()
        req = msgspec.convert(seed_a_body({"numcheck": mode}), GradientRequest)
        check = compute(req, EngineConfig()).numcheck
        assert check.evaluations == evaluations and check.passed
        # 83 parameters: one call holds them all; auto's plan times nothing
        assert batched_calls == [evaluations]
        assert check.max_rel_error < 1e-8


# --- the losses themselves, element by element ----------------------------------------------------------------
def _pieces(net: str):
    prep = prepare(_request(net, numcheck="exact"), EngineConfig(), torch.device("cpu"))
    model = copy.deepcopy(prep.model).to(torch.float64)
    params = dict(model.named_parameters())
    terms, targets = prep.terms, prep.targets

    def loss_fn():
        out = model(prep.inputs.first)
        return sum(t.weight * t(out, targets[t.name]) for t in terms)
    return params, loss_fn, batched_losses.batched(model, prep.inputs.tensors, targets, terms)


@pytest.mark.parametrize("net", sorted(NETS))
def test_batched_losses_and_differences_match_the_loop_element_by_element(net):
    params, loss_fn, batched = _pieces(net)
    picks = {n: torch.arange(p.numel()) for n, p in params.items()}
    worst_ulps = worst_fd = 0.0
    with torch.no_grad():
        scale = abs(float(loss_fn()))
        for call in batched_losses._plan(params, picks, batched):
            losses = batched.losses(batched_losses._perturbed(params, picks, call, EPS)).tolist()
            half, row = len(losses) // 2, 0
            for name, start, stop in call:
                flat = params[name].view(-1)
                for j, i in enumerate(picks[name][start:stop].tolist()):
                    orig = float(flat[i])
                    flat[i] = orig + EPS
                    plus = float(loss_fn())
                    flat[i] = orig - EPS
                    minus = float(loss_fn())
                    flat[i] = orig
                    bp, bm = losses[row + j], losses[half + row + j]
                    worst_ulps = max(worst_ulps, abs(bp - plus) / (tolerances.F64_EPS * scale),
                                     abs(bm - minus) / (tolerances.F64_EPS * scale))
                    worst_fd = max(worst_fd, abs((bp - bm) - (plus - minus)) / (2 * EPS))
                row += stop - start
    # A few float64 roundings of the loss (measured: up to 2-4), so each difference moves by at most
    # about ulps / eps: a fraction of the rounding floor, 8 roundings / eps.
    assert worst_ulps <= 8
    assert worst_fd <= 4 * tolerances.F64_EPS * scale / EPS


def test_batched_run_leaves_the_parameters_untouched():
    params, loss_fn, batched = _pieces("seed_a")
    before = {n: p.detach().clone() for n, p in params.items()}
    grads = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))
    for mode in ("exact", "sampled", "directional"):
        run(CheckRun(mode, params, loss_fn, grads, eps=EPS, tolerance=1e-6, samples=4, directions=8, seed=0,
                     batched=batched))
        assert all(torch.equal(p, before[n]) for n, p in params.items()), mode


# --- chunking --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit, row_elements", [(1 << 22, 0), (2_000, 0), (600, 40), (120, 0), (60, 0)])
def test_plan_covers_every_pick_once_within_the_bound(limit, row_elements, monkeypatch):
    monkeypatch.setattr(batched_losses, "BATCH_ELEMENTS", limit)
    params = dict(seed_a_module().named_parameters())
    batched = batched_losses.Batched(lambda p: None, row_elements)
    picks = {n: torch.arange(p.numel()) for n, p in params.items()}
    seen = {n: [] for n in params}
    for call in batched_losses._plan(params, picks, batched):
        names = [name for name, _, _ in call]
        assert len(names) == len(set(names))
        rows = 2 * sum(stop - start for _, start, stop in call)
        assert rows >= 2 and rows * (sum(params[n].numel() for n in names) + row_elements) <= limit
        for name, start, stop in call:
            seen[name] += picks[name][start:stop].tolist()
    for name, p in params.items():
        # a tensor too large to batch is left to the loop, whole
        assert seen[name] == ([] if batched.rows(p.numel()) == 0 else list(range(p.numel()))), name


def test_evaluations_too_large_to_pay_are_left_to_the_loop(monkeypatch):
    monkeypatch.setattr(batched_losses, "ROW_ELEMENTS_MAX", 40)
    params = dict(seed_a_module().named_parameters())  # 48, 8, 24, 3 elements
    picks = {n: torch.arange(p.numel()) for n, p in params.items()}
    plan = batched_losses._plan(params, picks, batched_losses.Batched(lambda p: None, 10))
    # 0.weight alone would hold 58 elements a row; 0.bias with 2.weight 42, so 2.weight opens a call of its own
    assert plan == [[("0.bias", 0, 8)], [("2.weight", 0, 24), ("2.bias", 0, 3)]]
    assert all(name != "0.weight" for call in plan for name, _, _ in call)


# 2,000 takes the longest; 600 and 60 chunk the same loop (make test-all runs all three).
@pytest.mark.parametrize("limit", [pytest.param(2_000, marks=pytest.mark.slow), 600, 60])
def test_chunked_batches_give_the_same_figures_and_counts(limit, monkeypatch):
    params, loss_fn, batched = _pieces("mlp_relu")
    grads = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))
    kw = dict(eps=EPS, tolerance=1e-6, samples=5, directions=8, seed=3)
    for mode in ("exact", "sampled", "directional"):
        ref = run(CheckRun(mode, params, loss_fn, grads, **kw))
        monkeypatch.setattr(batched_losses, "BATCH_ELEMENTS", limit)
        calls = []
        counting = batched_losses.Batched(lambda p: calls.append(1) or batched.losses(p), batched.row_elements)
        got = run(CheckRun(mode, params, loss_fn, grads, batched=counting, **kw))
        monkeypatch.setattr(batched_losses, "BATCH_ELEMENTS", 1 << 22)
        assert got.evaluations == ref.evaluations and got.passed == ref.passed, mode
        assert abs(got.max_abs_error - ref.max_abs_error) <= ref.rounding_floor / 4, mode
        count = sum(p.numel() for p in params.values())  # 435: a direction's two rows need 870 elements
        assert bool(calls) == (mode != "directional" or limit >= 2 * count), mode


# --- falling back -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fail_at", [0, 1, 2])
@pytest.mark.parametrize("mode", ["exact", "directional"])
def test_a_failing_batched_call_falls_back_to_the_loop(fail_at, mode, monkeypatch):
    monkeypatch.setattr(batched_losses, "BATCH_ELEMENTS", 400)  # several calls (two directions of 83 parameters each)
    params, loss_fn, batched = _pieces("seed_a")
    grads = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))
    calls = []

    def flaky(perturbed):
        calls.append(1)
        if len(calls) > fail_at:
            raise RuntimeError("vmap: no batching rule")
        return batched.losses(perturbed)

    kw = dict(eps=EPS, tolerance=1e-6, samples=4, directions=8, seed=0)
    seen = []
    got = run(CheckRun(mode, params, loss_fn, grads, batched=batched_losses.Batched(flaky, batched.row_elements),
                       progress=lambda *a: seen.append(a), **kw))
    ref = run(CheckRun(mode, params, loss_fn, grads, **kw))
    assert len(calls) == fail_at + 1  # no batched call after a failure
    assert got.evaluations == ref.evaluations and got.passed and ref.passed
    assert abs(got.max_abs_error - ref.max_abs_error) <= ref.rounding_floor / 4
    if fail_at == 0:
        assert got == ref  # all of it the loop's
    assert seen and all(done <= total for _, done, total in seen)


def test_a_job_timeout_inside_a_batched_call_is_not_swallowed():
    from rq.timeouts import JobTimeoutException

    params, loss_fn, batched = _pieces("seed_a")
    grads = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))

    def timed_out(perturbed):
        raise JobTimeoutException("past the job's timeout")

    with pytest.raises(JobTimeoutException):
        run(CheckRun("exact", params, loss_fn, grads, eps=EPS, tolerance=1e-6, samples=4, directions=8, seed=0,
                     batched=batched_losses.Batched(timed_out)))


@pytest.mark.parametrize("layers, why", [
    (SEED_A_LAYERS[:2] + [{"type": "Dropout", "p": 0.2}] + SEED_A_LAYERS[2:], "random"),
    ([SEED_A_LAYERS[0], {"type": "BatchNorm1d", "num_features": 8}] + SEED_A_LAYERS[1:], "buffers"),
    ([{"type": "Embedding", "num_embeddings": 10, "embedding_dim": 3, "max_norm": 1.0}, {"type": "Flatten"},
      {"type": "Linear", "in_features": 12, "out_features": 3}], "max_norm"),
    ([{"type": "GRU", "input_size": 6, "hidden_size": 4, "batch_first": True}, {"type": "Flatten"},
      {"type": "Linear", "in_features": 8, "out_features": 3}], "recurrent"),
])
def test_models_that_are_not_pure_functions_of_their_parameters_use_the_loop(layers, why, batched_calls):
    g, x, y = _batch()
    x = torch.randint(0, 10, (5, 4), generator=g) if why == "max_norm" else x
    x = torch.randn(5, 2, 6, generator=g, dtype=torch.float64) if why == "recurrent" else x
    body = {"model": {"layers": layers, "dtype": "float64", "seed": 0}, "inputs": tensor_json(x),
            "targets": tensor_json(y), "loss": "cross_entropy", "options": {"numcheck": "exact"}}
    check = compute(msgspec.convert(body, GradientRequest), EngineConfig()).numcheck
    # (max_norm: the loop's own forwards renormalise the weight in place, so elements are re-differenced)
    assert check.evaluations == 2 * sum(c.checked for c in check.per_parameter.values()) or why == "max_norm"
    assert check.passed or why == "max_norm"
    assert batched_calls == [], why


def test_random_models_graphs_that_write_buffers_and_other_devices_are_not_batchable():
    from gradclient.export import export_graph
    from gradsvc.engine.graph.compiler import build_graph
    from gradsvc.engine.spec import Limits

    model = seed_a_module()
    cpu = torch.device("cpu")
    assert batched_losses.batchable(model, cpu, graph=False, random=False)
    assert not batched_losses.batchable(model, cpu, graph=False, random=True)
    assert not batched_losses.batchable(model, torch.device("cuda"), graph=False, random=False)
    pure = build_graph(export_graph(model, (torch.randn(2, 6, dtype=torch.float64),)).graph, limits=Limits())
    assert batched_losses.batchable(pure, cpu, graph=True, random=False)
    bn = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)).double().train()
    stats = build_graph(export_graph(bn, (torch.randn(3, 6, dtype=torch.float64),)).graph, limits=Limits())
    assert not batched_losses.batchable(stats, cpu, graph=True, random=False)  # running statistics are written
