"""GPT-2 (built from a transformers config: nothing downloaded) stepped five times through the SDK against a live
stack with unchanged weights: the model is resident on the worker from the second step, the third and later steps
copy no byte into it and prepare it in under 2 ms (their median), and it answers the first step's gradients bit for
bit, which equal the same step run locally. A 0.4M-parameter GPT-2 in the default run; GPT-2 small (124M) marked
slow."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradclient import Client
from tests.support.models import GPT2LM

pytestmark = pytest.mark.timeout(900)
PREPARE_MS = 2.0  # a resident GPT-2 small's prepare on a CPU (docs/performance.md: 0.82-1.02 ms measured)


def _thrice(client: Client, model: nn.Module, vocab: int) -> None:
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, vocab, (2, 16), generator=g), torch.randint(0, vocab, (32,), generator=g)
    first, second, again, *more = (client.gradients(model, ids, y, numcheck="off", memory=False) for _ in range(5))
    # A resident step's prepare checks the weights' identities and the batch, and waits for nothing: no Redis round
    # trip (the graph's TTL is refreshed after the job). The median of three: a loaded host preempts a few.
    assert statistics.median(r.timings.prepare_ms for r in (again, *more)) < PREPARE_MS
    assert all((r.prepared, r.copied_bytes) == ("resident", 0) for r in more)
    # The SDK sends a trainable weight in the body the first time (up to 128 MiB), by reference once it comes back
    # unchanged: the worker copies such a weight in again on the second step (known by its bytes the first time, by
    # its refs the second), and nothing on the third.
    assert first.prepared == "built" and second.prepared == "resident"
    assert (again.prepared, again.copied_bytes) == ("resident", 0)
    assert again.upload_bytes < first.upload_bytes  # only the batch and the small tensors' bytes went up again
    loss = F.cross_entropy(model(ids), y)
    loss.backward()
    assert again.loss == first.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    for name, p in model.named_parameters():
        assert torch.equal(again.gradients[name], first.gradients[name]), name
        assert torch.allclose(again.gradients[name], p.grad, rtol=1e-3, atol=1e-6), name


def test_a_small_gpt2_stepped_again_is_resident_with_nothing_copied(client):
    torch.manual_seed(0)
    _thrice(client, GPT2LM(vocab_size=1024, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                      eos_token_id=0), 1024)


@pytest.mark.slow
def test_gpt2_small_stepped_again_is_resident_with_nothing_copied(client):
    torch.manual_seed(0)
    model = GPT2LM()
    assert sum(p.numel() for p in model.parameters()) > 124_000_000
    _thrice(client, model, 50257)
