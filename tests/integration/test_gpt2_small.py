"""GPT-2 small (124M parameters, transformers' GPT2Config defaults, built from the config: nothing
downloaded) once through the SDK against a live stack with the default limits: the weights go up by
reference in pieces, the gradients come back, and they equal the same step run locally."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradclient import Client

from ..support.models import GPT2LM
from ..support.stack import start_stack

# 208 s through the SDK on the shared 2-core machine (load 12; the suite is ~8.3 of its 10 minutes without it):
# marked slow, so `make test` leaves it out; `pytest -m slow` runs it.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_gpt2_small_runs_once_through_the_sdk_with_the_default_limits():
    torch.manual_seed(0)
    model = GPT2LM()  # transformers' defaults: GPT-2 small, 12 layers, width 768, 50,257 tokens
    count = sum(p.numel() for p in model.parameters())
    assert count > 124_000_000  # over the old 100M default, which refused it
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 50257, (1, 16), generator=g), torch.randint(0, 50257, (16,), generator=g)
    stack = start_stack(workers=1)  # no limit overridden
    try:
        with Client(stack.base_url, timeout=600) as client:
            result = client.gradients(model, ids, y, numcheck="off", memory=False)
    finally:
        stack.stop()
    assert result.parameter_count == count
    assert result.upload_bytes > 4 * 100_000_000  # every weight went up, by reference, in pieces
    loss = F.cross_entropy(model(ids), y)
    loss.backward()
    assert result.loss == pytest.approx(float(loss), rel=1e-5)
    for name, p in model.named_parameters():
        got = result.gradients[name]
        assert got.shape == p.grad.shape and torch.allclose(got, p.grad, rtol=1e-3, atol=1e-6), name
