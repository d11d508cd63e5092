"""Public-style training code through the SDK, the API, Redis and a real worker, as its authors wrote it:
nanoGPT's SDPA attention with transpose().contiguous().view(), the examples repository's VAE (randn_like,
BCE + KL inside forward), Llama's complex rotary embedding, a Siamese net with cosine_similarity, an
LSTMCell loop. Each gradient equals local autograd (float32: within 1e-4 of the tensor's largest)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.support.public_models import VAE, CausalSelfAttention, RotaryAttention, Sequence, Siamese

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
    assert not torch.equal(torch.as_tensor(fresh.gradients["fc1.weight"]), torch.as_tensor(result.gradients["fc1.weight"]))


@pytest.mark.parametrize("table", ["buffer", "attribute"])
def test_llama_rotary_embedding_with_complex_ops(client, table):
    torch.manual_seed(0)
    model, x, y = RotaryAttention(table=table), torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    result = client.gradients(model, x, y, loss="mse", numcheck="exact")
    assert_close(result, local(model, lambda: F.mse_loss(model(x), y)))
    assert result.numcheck.passed, result.numcheck


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
