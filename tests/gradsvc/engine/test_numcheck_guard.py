"""The numerical check never takes a job down: whatever fails inside it, the job answers its gradients (equal to
local autograd) with `passed` null and a reason that names what failed; what is not the check's own failure (a
canceled job) still ends the job. And one of the crashes that once did take jobs down, fixed at its cause: a
tensor made in forward with torch's default dtype (`torch.zeros(n, 5)`), written with index_put, in the check's
float64 run."""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch
from torch import nn

from gradsvc.engine import Engine, EngineConfig
from gradsvc.engine import numcheck as numcheck_package
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest
from tests.support.check_cases import local_gradients, wire_body


class Scatter(nn.Module):
    """Writes a Linear's outputs into columns of a zeros tensor it makes with no dtype (torch's default)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = self.lin(x)  # (batch, 3)
        out = torch.zeros(x.shape[0], 5)  # (batch, 5), float32: no dtype named
        out[:, torch.tensor([0, 2, 4])] = torch.tanh(h)
        return out * torch.arange(1.0, 6.0)  # arange of floats: the default dtype too


def _case(seed: int):
    torch.manual_seed(seed)
    return Scatter(), (torch.randn(6, 4),), torch.randn(6, 5), "mse"


def _request(case, dtype: str, **options) -> GradientRequest:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(wire_body(case, dtype, **options)), type=GradientRequest)


def _assert_equal_to_local(result, case, rtol: float, dtype: str) -> None:
    """The answer key: eager autograd in the request's dtype; in float64 with torch's default dtype float64 too,
    as a user runs this module in float64 (eager's zeros would otherwise refuse float64 values)."""
    model, (x,), y, loss = case
    if dtype == "float64":
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            want = local_gradients((copy.deepcopy(model).double(), (x.double(),), y.double(), loss))
        finally:
            torch.set_default_dtype(previous)
    else:
        want = local_gradients(case)
    for name, g in want.items():
        got = decode(result.gradients[name], where=name, max_elements=1 << 20).to(torch.float64)
        torch.testing.assert_close(got, g.to(torch.float64), rtol=rtol, atol=rtol * float(g.abs().max()))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_default_dtype_tensor_written_in_forward_is_checked_in_float64(seed, dtype):
    case = _case(seed)
    result = Engine(EngineConfig()).compute(_request(case, dtype, numcheck="exact"))
    assert result.numcheck.passed is True, result.numcheck.reason
    assert result.numcheck.mode == "exact" and result.numcheck.max_rel_error < 1e-6
    _assert_equal_to_local(result, case, 1e-5 if dtype == "float32" else 1e-12, dtype)


@pytest.mark.parametrize("failure", [RuntimeError("no float64 kernel for this op"), IndexError("index 7 is out of "
                                     "bounds"), TypeError("unsupported operand"), MemoryError()])
def test_a_check_that_fails_inside_answers_the_gradients_unchecked(monkeypatch, failure):
    def broken(inputs):
        raise failure

    monkeypatch.setattr(numcheck_package, "_check", broken)
    case = _case(0)
    result = Engine(EngineConfig()).compute(_request(case, "float64", numcheck="exact"))
    check = result.numcheck
    assert check.passed is None and check.mode == "off" and check.evaluations == 0
    assert check.reason.startswith("not run: the numerical check failed inside")
    assert type(failure).__name__ in check.reason
    _assert_equal_to_local(result, case, 1e-12, "float64")


class _Canceled(Exception):
    """What a worker's progress callback raises when the job is canceled: not a failure of the check."""


def test_an_interruption_during_the_check_still_ends_the_job(monkeypatch):
    def interrupted(inputs):
        raise _Canceled()

    monkeypatch.setattr(numcheck_package, "_check", interrupted)
    with pytest.raises(_Canceled):
        Engine(EngineConfig()).compute(_request(_case(0), "float64", numcheck="exact"))


class PaddedLM(nn.Module):
    """Token embeddings with a padding row (every Hugging Face LM's pad_token_id), the loss over every position."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6, padding_idx=3)
        self.head = nn.Linear(6, 12)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids))).flatten(0, 1)  # (batch * seq, vocab)


@pytest.mark.parametrize("form", ["graph", "layers"])
def test_an_embeddings_padding_row_is_judged_as_autograd_defines_it(form):
    """The padding row's gradient is 0 by definition although the forward reads the row: the check holds it, so a
    right answer passes (it once failed with a relative error of 1.0), and the held rows are listed."""
    torch.manual_seed(0)
    ids = torch.tensor([[3, 1, 2, 3], [4, 3, 5, 6]])  # padding among the tokens
    targets = torch.randint(0, 12, (8,))
    if form == "graph":
        body = wire_body((PaddedLM(), (ids,), targets, "cross_entropy"), "float64", numcheck="exact")
    else:
        body = {"model": {"layers": [{"type": "Embedding", "num_embeddings": 12, "embedding_dim": 6, "padding_idx": 3},
                                     {"type": "Flatten"}, {"type": "Linear", "in_features": 24, "out_features": 5}],
                          "dtype": "float64"},
                "inputs": {"dtype": "int64", "shape": [2, 4], "data": ids.tolist()}, "targets": [0, 4],
                "loss": "cross_entropy", "options": {"numcheck": "exact"}}
    result = Engine(EngineConfig()).compute(msgspec.convert(msgspec.json.decode(msgspec.json.encode(body)),
                                                            GradientRequest))
    assert result.numcheck.passed is True, result.numcheck.per_parameter
    assert any("padding_idx 3" in h for h in result.numcheck.held)
    grad = decode(result.gradients["emb.weight" if form == "graph" else "0.weight"], where="g", max_elements=1 << 20)
    assert float(grad[3].abs().max()) == 0.0 and float(grad[1].abs().max()) > 0
