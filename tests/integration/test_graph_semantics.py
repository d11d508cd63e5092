"""Public-style training code through the SDK, the API, Redis and a real worker, as its authors wrote it:
nanoGPT's SDPA attention with transpose().contiguous().view(), the examples repository's VAE (randn_like,
BCE + KL inside forward), Llama's complex rotary embedding, a Siamese net with cosine_similarity, an
LSTMCell loop. Each gradient equals local autograd (float32: within 1e-4 of the tensor's largest)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.nn import functional as F

from gradclient.export import export_graph
from gradclient.tensors import to_wire
from tests.support.public_models import VAE, CausalSelfAttention, RotaryAttention, Sequence, Siamese, SpectralMix

pytestmark = pytest.mark.timeout(600)
TOL = 1e-4


def local(model, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_close(result, want: dict[str, torch.Tensor]) -> None:
    got = {n: torch.as_tensor(g) for n, g in result.gradients.items() if g is not None}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, g in want.items():
        scale = max(float(g.abs().max()), 1e-30)
        err = float((got[name].to(g.dtype) - g).abs().max())
        assert err <= TOL * scale, f"{name}: max error {err:.3g} against scale {scale:.3g}"


def test_nanogpt_attention_with_transpose_contiguous_view(client):
    torch.manual_seed(0)
    model, x, y = CausalSelfAttention(), torch.randn(3, 6, 16), torch.randn(3, 6, 16)
    result = client.gradients(model, x, y, loss="mse", numcheck="exact")
    assert_close(result, local(model, lambda: F.mse_loss(model(x), y)))
    assert result.numcheck.passed, result.numcheck


def test_vae_with_randn_like_and_its_bce_and_kl_loss_follows_the_seed(client):
    torch.manual_seed(0)
    model, x = VAE(), torch.rand(5, 20)
    result = client.gradients(model, x, loss="output", numcheck="exact")
    torch.manual_seed(result.seed)  # the noise the worker drew: torch's CPU stream for the job's seed
    want = local(model, lambda: model(x))
    assert_close(result, want)
    assert result.numcheck.passed, result.numcheck  # the noise held still across the check's forwards
    again = client.gradients(model, x, loss="output", numcheck="off", seed=result.seed)
    assert torch.equal(torch.as_tensor(again.gradients["fc1.weight"]), torch.as_tensor(result.gradients["fc1.weight"]))
    fresh = client.gradients(model, x, loss="output", numcheck="off")
    assert fresh.seed != result.seed
    first = torch.as_tensor(result.gradients["fc1.weight"])
    assert not torch.equal(torch.as_tensor(fresh.gradients["fc1.weight"]), first)


@pytest.mark.parametrize("table, wire_format", [("buffer", "msgpack"), ("attribute", "json")])
def test_llama_rotary_embedding_with_complex_ops(stack, table, wire_format):
    """The complex rotary table travels as a buffer (MessagePack raw bytes) or a graph constant (JSON b64)."""
    torch.manual_seed(0)
    model, x, y = RotaryAttention(table=table), torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    with stack.sdk_client(wire_format=wire_format) as client:
        result = client.gradients(model, x, y, loss="mse", numcheck="exact")
    assert_close(result, local(model, lambda: F.mse_loss(model(x), y)))
    assert result.numcheck.passed, result.numcheck


def test_a_complex_input_in_json_as_real_imaginary_pairs(http):
    """A curl user's body: the complex input as nested [real, imaginary] pairs, the graph exported by the SDK."""
    torch.manual_seed(0)
    model, z, y = SpectralMix(), torch.randn(3, 4, dtype=torch.complex64), torch.randn(3, 3)
    eg = export_graph(model, (z,))
    body = {"model": {"graph": msgspec.to_builtins(eg.graph), "dtype": "float32",
                      "weights": {k: msgspec.to_builtins(to_wire(v, "json")) for k, v in eg.weights.items()}},
            "inputs": {"dtype": "complex64", "shape": [3, 4], "data": torch.view_as_real(z).tolist()},
            "targets": y.tolist(), "loss": "mse", "options": {"numcheck": "exact", "encoding": "list"}}
    r = http.post("/gradients?wait=120", json=body)
    assert r.status_code == 200, r.text
    want = local(model, lambda: F.mse_loss(model(z), y))
    got = {n: torch.tensor(t["data"], dtype=torch.float32) for n, t in r.json()["gradients"].items()}
    for name, g in want.items():
        assert float((got[name] - g).abs().max()) <= TOL * float(g.abs().max()), name
    assert r.json()["numcheck"]["passed"]


def test_siamese_pairs_scored_by_cosine_similarity(client):
    torch.manual_seed(0)
    model, a, b, y = Siamese(), torch.randn(6, 10), torch.randn(6, 10), torch.rand(6)
    result = client.gradients(model, (a, b), y, loss="mse", numcheck="exact")
    assert_close(result, local(model, lambda: F.mse_loss(model(a, b), y)))
    assert result.numcheck.passed, result.numcheck


def test_lstmcell_time_series_loop(client):
    torch.manual_seed(0)
    model, x = Sequence(), torch.randn(4, 9)
    y = torch.roll(x, -1, dims=1)
    result = client.gradients(model, x, y, loss="mse", numcheck="exact")
    assert_close(result, local(model, lambda: F.mse_loss(model(x), y)))
    assert result.numcheck.passed, result.numcheck
