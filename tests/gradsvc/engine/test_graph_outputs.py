"""Graph models' outputs beyond the first, in process (prepare() and compute()): the model's own loss found
where forward puts it (a tuple's scalar, a dict's 'loss', or named), forward's outputs returned in its own
structure, the buffers forward writes returned as one step leaves them, and nested inputs (an RNN's state)."""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradclient.export import export_graph
from gradclient.tensors import from_wire, inputs_to_wire, to_wire
from gradsvc.engine import EngineConfig, SpecError, compute
from gradsvc.wire import GradientRequest

from tests.support.public_models import GCN, normalised_adjacency

CONFIG = EngineConfig()


def request(model: nn.Module, inputs, loss="output", *, targets=None, **options) -> GradientRequest:
    """The request the SDK sends for `model` called on `inputs` (a tuple of forward's arguments)."""
    exported = export_graph(model, inputs)
    body = {"model": {"graph": exported.graph, "dtype": "float32",
                      "weights": {k: to_wire(v) for k, v in exported.weights.items()}},
            "inputs": inputs_to_wire(list(inputs)), "loss": loss, "options": {"numcheck": "off", **options}}
    if targets is not None:
        body["targets"] = to_wire(targets)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def local(model: nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss_fn().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(result, want: dict[str, torch.Tensor], tol: float = 1e-4) -> None:
    got = {n: from_wire(t) for n, t in result.gradients.items() if t is not None}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, g in want.items():
        err = float((got[name] - g).abs().max())
        assert err <= tol * max(float(g.abs().max()), 1e-30), f"{name}: {err:.3g}"


class TinyGPT(nn.Module):
    """forward(idx, targets) -> (logits, loss), as nanoGPT and minGPT write it."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(23, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 23)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        logits = self.head(self.block(self.wte(idx)))  # (batch, seq, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 23, (3, 6), generator=g), torch.randint(0, 23, (3, 6), generator=g)


def test_the_loss_a_forward_returns_second_is_differentiated():
    torch.manual_seed(0)
    model, (idx, targets) = TinyGPT(), gpt_batch()
    result = compute(request(model, (idx, targets)), CONFIG)
    assert result.loss == pytest.approx(float(model(idx, targets)[1]), rel=1e-5)
    assert_close(result, local(model, lambda: model(idx, targets)[1]))


def test_a_named_output_picks_the_loss_and_a_non_scalar_name_is_refused():
    torch.manual_seed(0)
    model, (idx, targets) = TinyGPT(), gpt_batch()
    result = compute(request(model, (idx, targets), loss={"output": 1}), CONFIG)
    assert_close(result, local(model, lambda: model(idx, targets)[1]))
    with pytest.raises(SpecError, match=r"not a floating scalar") as err:
        compute(request(model, (idx, targets), loss={"output": 0}), CONFIG)
    assert err.value.code == "bad_loss"


class TwoScalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor):
        out = self.lin(x)
        return out, out.pow(2).mean(), out.abs().mean()


def test_several_scalar_outputs_are_a_bad_loss_listing_them_until_one_is_named():
    torch.manual_seed(0)
    model, x = TwoScalars(), torch.randn(5, 4)
    with pytest.raises(SpecError, match=r"\[1\], \[2\]") as err:
        compute(request(model, (x,)), CONFIG)
    assert err.value.code == "bad_loss" and err.value.detail["candidates"] == ["[1]", "[2]"]
    result = compute(request(model, (x,), loss={"output": 2}), CONFIG)
    assert_close(result, local(model, lambda: model(x)[2]))


class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        logits = self.lin(x)
        return {"logits": logits, "aux": logits.mean(), "loss": F.cross_entropy(logits, y)}


def test_a_dicts_loss_is_the_models_own_loss_and_outputs_come_back_by_key():
    torch.manual_seed(0)
    model, x, y = DictOutput(), torch.randn(5, 4), torch.tensor([0, 2, 1, 1, 0])
    result = compute(request(model, (x, y), outputs=True), CONFIG)
    assert_close(result, local(model, lambda: model(x, y)["loss"]))
    assert set(result.outputs) == {"logits", "aux", "loss"}
    want = model(x, y)
    for key in want:
        assert torch.allclose(from_wire(result.outputs[key]), want[key].detach(), atol=1e-6), key


class Normed(nn.Module):
    """Batch norm in training mode and an EMA buffer written in place: both written by every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6, bias=False)  # batch norm cancels a bias: its gradient is rounding alone
        self.norm = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return self.out(torch.relu(h))


def test_buffers_forward_writes_come_back_as_one_local_step_leaves_them():
    torch.manual_seed(0)
    model, x, y = Normed().train(), torch.randn(8, 4), torch.randint(0, 3, (8,))
    req = request(copy.deepcopy(model), (x,), loss="cross_entropy", targets=y, timing_repeat=3)
    result = compute(req, CONFIG)
    assert_close(result, local(model, lambda: F.cross_entropy(model(x), y)))  # one local step
    got = {n: from_wire(t) for n, t in result.buffers.items()}
    assert set(got) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked", "ema"}
    for name, value in model.named_buffers():
        assert torch.allclose(got[name], value, atol=1e-6), name  # three timed passes, one step's buffers


def test_in_eval_mode_only_what_forward_still_writes_comes_back():
    torch.manual_seed(0)
    model, x, y = Normed().eval(), torch.randn(8, 4), torch.randint(0, 3, (8,))
    result = compute(request(model, (x,), loss="cross_entropy", targets=y), CONFIG)
    assert set(result.buffers) == {"ema"}  # batch norm reads its statistics in eval mode; the EMA still moves
    assert result.outputs is None


class StatefulLM(nn.Module):
    """An LSTM language model carrying (h, c) from one call to the next."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 8)
        self.rnn = nn.LSTM(8, 12, batch_first=True)
        self.head = nn.Linear(12, 17)

    def forward(self, ids: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        out, (h, c) = self.rnn(self.embed(ids), state)
        return self.head(out).flatten(0, 1), (h, c)  # (batch*seq, vocab)


def test_nested_inputs_carry_an_lstm_state_and_outputs_return_the_next_one():
    torch.manual_seed(0)
    model = StatefulLM()
    ids, y = torch.randint(0, 17, (3, 5)), torch.randint(0, 17, (15,))
    state = (torch.randn(1, 3, 12), torch.randn(1, 3, 12))
    result = compute(request(model, (ids, state), loss="cross_entropy", targets=y, outputs=True), CONFIG)
    assert_close(result, local(model, lambda: F.cross_entropy(model(ids, state)[0], y)))
    logits, (h, c) = model(ids, state)
    got_logits, [got_h, got_c] = result.outputs
    assert torch.allclose(from_wire(got_h), h.detach(), atol=1e-6)
    assert torch.allclose(from_wire(got_c), c.detach(), atol=1e-6)
    assert torch.allclose(from_wire(got_logits), logits.detach(), atol=1e-5)
    assert result.buffers is None  # forward writes no buffer


def test_options_outputs_is_refused_with_micro_batch():
    torch.manual_seed(0)
    model = StatefulLM()
    ids, y = torch.randint(0, 17, (4, 5)), torch.randint(0, 17, (20,))
    state = (torch.zeros(1, 4, 12), torch.zeros(1, 4, 12))
    with pytest.raises(SpecError, match="options.outputs") as err:
        compute(request(model, (ids, state), loss="cross_entropy", targets=y, outputs=True, micro_batch=2), CONFIG)
    assert err.value.code == "bad_option"


def test_splitting_the_batch_is_refused_for_a_state_batched_along_dim_1():
    torch.manual_seed(0)
    model = StatefulLM()
    ids, y = torch.randint(0, 17, (4, 5)), torch.randint(0, 17, (20,))
    state = (torch.zeros(1, 4, 12), torch.zeros(1, 4, 12))
    with pytest.raises(SpecError, match="options.micro_batch") as err:
        compute(request(model, (ids, state), loss="cross_entropy", targets=y, micro_batch=2), CONFIG)
    assert err.value.code == "bad_option"




@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_gcn_takes_its_sparse_adjacency_as_written(layout):
    torch.manual_seed(0)
    model, x, y = GCN(), torch.randn(7, 5), torch.randint(0, 3, (7,))
    adj = normalised_adjacency().to_sparse() if layout == "coo" else normalised_adjacency().to_sparse_csr()
    result = compute(request(model, (x, adj), loss="nll", targets=y), CONFIG)
    assert_close(result, local(model, lambda: F.nll_loss(model(x, adj), y)))
    assert_close(result, local(model, lambda: F.nll_loss(model(x, normalised_adjacency().to_dense()), y)))


def test_a_sparse_input_whose_indices_leave_its_shape_is_a_bad_tensor():
    model, x = GCN(), torch.randn(7, 5)
    req = request(model, (x, normalised_adjacency().to_sparse()), loss="nll", targets=torch.randint(0, 3, (7,)))
    nnz = req.inputs[1]["values"]["shape"][0]
    req.inputs[1]["indices"]["data"] = torch.full((2, nnz), 9).numpy().tobytes()  # row and column 9 of 7
    with pytest.raises(SpecError, match=r"inputs\[1\]: not a valid sparse_coo tensor") as err:
        compute(req, CONFIG)
    assert err.value.code == "bad_tensor"
