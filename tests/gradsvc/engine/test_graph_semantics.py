"""A graph means what its program says on any device and kernel, and public training code runs as written:
nanoGPT's SDPA + transpose().contiguous().view(), random ops replayed from the job's seed (a VAE's
randn_like), complex intermediates (Llama's rotary embedding), cosine_similarity, LSTMCell loops. Each
against eager autograd, in process (prepare, the meta shape check, compute with the numerical check)."""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import from_wire, to_wire
from gradsvc.engine import EngineConfig, SpecError, compute, prepare
from gradsvc.engine.graph.compiler import build_graph
from gradsvc.engine.devices import is_random
from gradsvc.engine.graph.meta_check import validate_graph_shapes
from gradsvc.engine.graph.ops import OPS
from gradsvc.wire import GradientRequest

from tests.support.public_models import VAE, CausalSelfAttention, Noisy, RotaryAttention, Sequence, Siamese, SpectralMix

from .test_graph import LIMITS, graph_model, over_the_wire

CONFIG = EngineConfig()
TOL32 = 1e-4


def request(model: nn.Module, inputs: tuple, targets=None, loss: str = "output", *, dtype: str = "float32",
            seed: int = 0, **options) -> GradientRequest:
    eg = export_graph(model, inputs)
    wired = [to_wire(x, "msgpack") for x in inputs]
    body = {"model": {"graph": eg.graph, "dtype": dtype, "seed": seed,
                      "weights": {k: to_wire(v, "msgpack") for k, v in eg.weights.items()}},
            "inputs": wired[0] if len(wired) == 1 else wired, "loss": loss,
            "options": {"numcheck": "off", "memory": False, **options}}
    if targets is not None:
        body["targets"] = to_wire(targets, "msgpack")
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def eager(model: nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_close(result, want: dict[str, torch.Tensor], tol: float = TOL32) -> None:
    got = {n: from_wire(t) for n, t in result.gradients.items() if t is not None}
    assert set(got) == set(want)
    for name, g in want.items():
        scale = max(float(g.abs().max()), 1e-30)
        err = float((got[name].to(g.dtype) - g).abs().max())
        assert err <= tol * scale, f"{name}: error {err:.3g} > {tol} x {scale:.3g}"


def test_view_of_a_transposed_sdpa_output_passes_the_meta_shape_check():
    """At capture the CPU kernel's layout made .contiguous() a no-op, so the graph holds a bare view of a
    transposed tensor; torch's meta kernel lays SDPA's output out otherwise. The view runs as reshape."""
    torch.manual_seed(0)
    model, x = CausalSelfAttention(), torch.randn(2, 5, 16)
    eg = export_graph(model, (x,))
    assert "aten.contiguous.default" not in {n.op for n in eg.graph.nodes}  # what makes the graph layout-bound
    out = validate_graph_shapes(build_graph(eg.graph, limits=LIMITS), x.to("meta"))
    assert out.shape == (2, 5, 16)


def test_view_runs_as_a_view_where_the_layout_allows_and_copies_where_it_does_not():
    view = OPS["aten.view.default"].fn
    x = torch.randn(2, 3, 4)
    assert view(x, [6, 4]).data_ptr() == x.data_ptr() and view(x, [6, 4])._base is x
    t = x.transpose(0, 1)
    assert torch.equal(view(t, [12, 2]), t.reshape(12, 2))
    assert torch.equal(OPS["aten._unsafe_view.default"].fn(t, [3, 8]), t.reshape(3, 8))
    assert torch.equal(OPS["aten.view_as.default"].fn(t, torch.empty(24)), t.reshape(24))


def test_nanogpt_attention_with_contiguous_view_equals_eager_and_passes_the_check():
    torch.manual_seed(0)
    model, x, y = CausalSelfAttention(), torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    result = compute(request(model, (x,), y, "mse", numcheck="exact"), CONFIG)
    assert_close(result, eager(model, lambda: nn.functional.mse_loss(model(x), y)))
    assert result.numcheck.passed, result.numcheck


def test_vae_with_randn_like_and_bce_inside_forward_equals_eager_under_the_jobs_seed():
    torch.manual_seed(0)
    model, x = VAE(), torch.rand(4, 20)
    result = compute(request(model, (x,), seed=11, numcheck="exact"), CONFIG)
    torch.manual_seed(11)
    want = eager(model, lambda: model(x))
    assert_close(result, want)
    torch.manual_seed(11)
    assert result.loss == pytest.approx(float(model(x)), rel=1e-5)
    # The noise stays fixed across the numerical check's forwards (and is the float32 run's in float64).
    assert result.numcheck.passed, result.numcheck
    other = compute(request(model, (x,), seed=12), CONFIG)
    assert not torch.equal(from_wire(other.gradients["fc1.weight"]), from_wire(result.gradients["fc1.weight"]))
    again = compute(request(model, (x,), seed=11), CONFIG)
    assert torch.equal(from_wire(again.gradients["fc1.weight"]), from_wire(result.gradients["fc1.weight"]))


def test_every_random_op_replays_eager_under_a_seed_and_float64_draws_the_float32_numbers():
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(4, 6)
    eg = export_graph(model, (x,))
    ops = {n.op for n in eg.graph.nodes}
    assert {"aten.randn_like.default", "aten.rand_like.default", "aten.randn.default", "aten.rand.default",
            "aten.bernoulli.default", "aten.bernoulli_.float", "aten.normal.Tensor_float", "aten.randperm.default",
            "aten.multinomial.default", "aten.randint.low"} <= ops, ops
    graph, weights = over_the_wire(eg, "json")
    gm = graph_model(graph, weights)
    assert is_random(gm)  # the job's runs fork the RNG and seed it
    torch.manual_seed(5)
    got = gm(x)
    torch.manual_seed(5)
    want = model(x)
    assert torch.equal(got, want)
    torch.manual_seed(6)
    assert not torch.equal(gm(x), want)
    g64 = graph_model(graph, weights, dtype=torch.float64)
    g64.upcast_all = True
    torch.manual_seed(5)
    assert (g64(x.double()) - want.double()).abs().max() < 1e-6  # the same numbers, not float64's own stream
    prepare(request(model, (x,), torch.randn(4, 6), "mse"), CONFIG)  # the meta shape check runs each one


class NoiseInjection(nn.Module):
    """Gaussian noise on the hidden features in training, as denoising and regularising nets add it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + 0.1 * torch.randn_like(h))


@pytest.mark.parametrize("option", [{"micro_batch": 2}, {"per_sample": "norms"}, {"shards": 2}])
def test_options_splitting_the_batch_are_refused_for_a_graph_drawing_random_numbers(option):
    """A part of the batch draws other noise than the whole batch: its gradients would not add up."""
    torch.manual_seed(0)
    with pytest.raises(SpecError) as err:
        prepare(request(NoiseInjection(), (torch.randn(4, 6),), torch.randn(4, 3), "mse", **option), CONFIG)
    assert err.value.code == "bad_option" and "randn_like" in err.value.message
    assert f"remove options.{next(iter(option))}" in err.value.message


def test_a_generator_argument_in_a_graph_is_refused_saying_the_seed_decides():
    torch.manual_seed(0)
    eg = export_graph(VAE(), (torch.rand(2, 20),))
    graph = copy.deepcopy(eg.graph)
    node = next(n for n in graph.nodes if n.op == "aten.randn_like.default")
    node.op, node.args, node.kwargs = "aten.bernoulli.default", node.args, {"generator": 3}
    with pytest.raises(Exception) as err:
        build_graph(graph, limits=LIMITS)
    assert err.value.code == "bad_option" and "job's seed" in err.value.message


@pytest.mark.parametrize("table", ["buffer", "attribute"])
def test_llama_rotary_embedding_with_complex_ops_equals_eager(table):
    torch.manual_seed(0)
    model, x, y = RotaryAttention(table=table), torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    eg = export_graph(model, (x,))
    ops = {n.op for n in eg.graph.nodes}
    assert {"aten.view_as_complex.default", "aten.view_as_real.default"} <= ops
    result = compute(request(model, (x,), y, "mse", numcheck="exact"), CONFIG)
    assert_close(result, eager(model, lambda: nn.functional.mse_loss(model(x), y)))
    assert result.numcheck.passed, result.numcheck


def test_a_complex_buffer_follows_the_float64_copy_as_complex128():
    model = RotaryAttention()
    gm = graph_model(*over_the_wire(export_graph(model, (torch.randn(2, 6, 16),)), "msgpack"))
    assert gm.get_buffer("freqs_cis").dtype == torch.complex64
    g64 = copy.deepcopy(gm).to(torch.float64)
    assert g64.get_buffer("freqs_cis").dtype == torch.complex128
    assert torch.equal(g64.get_buffer("freqs_cis"), model.freqs_cis.to(torch.complex128))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_complex_input_takes_the_runs_dtype_and_its_gradients_equal_eager(dtype):
    torch.manual_seed(0)
    model, z, y = SpectralMix(), torch.randn(3, 4, dtype=dtype), torch.randn(3, 3)
    if dtype == torch.complex128:
        model, y = model.double(), y.double()
    result = compute(request(model, (z,), y, "mse", dtype="float64" if dtype == torch.complex128 else "float32",
                             numcheck="exact"), CONFIG)
    assert_close(result, eager(model, lambda: nn.functional.mse_loss(model(z), y)),
                 TOL32 if dtype == torch.complex64 else 1e-10)
    assert result.numcheck.passed, result.numcheck


def test_siamese_cosine_similarity_equals_eager():
    torch.manual_seed(0)
    model, a, b, y = Siamese(), torch.randn(5, 10), torch.randn(5, 10), torch.rand(5)
    result = compute(request(model, (a, b), y, "mse", numcheck="exact"), CONFIG)
    assert_close(result, eager(model, lambda: nn.functional.mse_loss(model(a, b), y)))
    assert result.numcheck.passed, result.numcheck


def test_lstmcell_loop_equals_eager():
    torch.manual_seed(0)
    model, x, y = Sequence(), torch.randn(3, 7), torch.randn(3, 7)
    result = compute(request(model, (x,), y, "mse", numcheck="exact"), CONFIG)
    assert_close(result, eager(model, lambda: nn.functional.mse_loss(model(x), y)))
    assert result.numcheck.passed, result.numcheck
