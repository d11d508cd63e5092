"""Graph models of real training code against eager autograd: T5's min/max with a tensor, language
models with nn.GRU / nn.LSTM / nn.RNN inside a custom module, and no_grad blocks and detach in forward."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from gradclient.export import export_graph
from gradsvc.engine.graph.batch_flow import batch_mixing_nodes, draws_masks
from gradsvc.engine.graph.compiler import build_graph

from tests.support.models import RecurrentLM
from .test_graph import LIMITS, assert_grads_close, grads, graph_model, over_the_wire

CELLS = [("gru", True), ("gru", False), ("lstm", True), ("lstm", False), ("rnn_tanh", True), ("rnn_relu", False)]


def tokens(batch: int = 3, seq: int = 5) -> torch.Tensor:
    return torch.randint(0, 16, (batch, seq), generator=torch.Generator().manual_seed(1))


def recurrent_lm(cell: str, batch_first: bool, **kw) -> RecurrentLM:
    torch.manual_seed(0)
    return RecurrentLM(cell, batch_first, **kw)


@pytest.mark.parametrize("cell, batch_first", CELLS)
def test_recurrent_language_models_match_eager_in_float32_and_float64(cell, batch_first):
    model, x = recurrent_lm(cell, batch_first), tokens()
    eg = export_graph(model, (x,))
    assert eg.dynamic_batch
    ops = {n.op for n in eg.graph.nodes}
    assert f"aten.{cell}.input" in ops, ops  # what torch.export emits for the module, both layouts
    graph, weights = over_the_wire(eg, "msgpack")
    for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-10)):
        ref = copy.deepcopy(model).to(dtype)
        out, got = grads(graph_model(graph, weights, dtype=dtype), x)
        want_out, want = grads(ref, x)
        assert out.dtype == dtype and out.shape == want_out.shape == (3, 16)
        assert_grads_close(got, want, tol)
    assert batch_mixing_nodes(build_graph(graph, limits=LIMITS), list(x.shape)) == []  # one row per example


def test_a_recurrent_op_reading_the_batch_as_its_time_axis_mixes_the_batch():
    """A graph whose GRU takes (batch, seq, dim) as (seq, batch, dim): each example's state flows into the
    next example's. torch.export cannot make that batch dynamic (it unrolls over time), so the graph is
    written by hand: the per-example export with batch_first switched off and h_0 sized by the sequence."""
    eg = export_graph(recurrent_lm("gru", True), (tokens(),))
    graph = copy.deepcopy(eg.graph)
    gru = next(n for n in graph.nodes if n.op == "aten.gru.input")
    gru.args[8] = False  # batch_first
    size = next(n for n in graph.nodes if n.op == "aten.sym_size.int")
    size.args[1] = 1  # h_0: (layers, seq, hidden)
    assert batch_mixing_nodes(build_graph(graph, limits=LIMITS), [3, 5]) == [("gru", "aten.gru.input", "rnn")]


class InitialState(nn.Module):
    """h_0 computed from each example (an encoder summary), as seq2seq decoders start."""

    def __init__(self) -> None:
        super().__init__()
        self.init, self.rnn, self.head = nn.Linear(4, 5), nn.GRU(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.init(x.mean(1)))[None]  # (1, batch, 5)
        return self.head(self.rnn(x, h0)[0][:, -1])  # (batch, 3)


def test_an_initial_state_from_the_data_stays_per_example():
    torch.manual_seed(0)
    model, x = InitialState().double(), torch.randn(3, 6, 4, dtype=torch.float64)
    eg = export_graph(model, (x,))
    gm = graph_model(*over_the_wire(eg, "json"), dtype=torch.float64)
    assert_grads_close(grads(gm, x)[1], grads(model, x)[1], 1e-10)
    assert batch_mixing_nodes(build_graph(eg.graph, limits=LIMITS), [3, 6, 4]) == []


def test_dropout_between_recurrent_layers_draws_masks_in_training_only():
    model, x = recurrent_lm("lstm", True, dropout=0.5), tokens()
    steps = build_graph(export_graph(model, (x,)).graph, limits=LIMITS)._graph.steps
    assert [s.op.name for s in steps if draws_masks(s)] == ["aten.lstm.input"]
    steps = build_graph(export_graph(model.eval(), (x,)).graph, limits=LIMITS)._graph.steps
    assert not any(draws_masks(s) for s in steps)


class T5Style(nn.Module):
    """T5's relative-position buckets (torch.min with a tensor of the last bucket) and a torch.max of two
    tensors, which export as aten.min.other / aten.max.other."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bias = nn.Embedding(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # (batch, 6)
        pos = torch.arange(6)[None, :] - torch.arange(6)[:, None]  # (6, 6)
        large = 4 + (pos.abs().float().log1p() * 2).to(torch.long)
        bucket = torch.min(large, torch.full_like(large, 7))  # far positions share the last bucket
        return torch.max(h, h.flip(-1)) + torch.min(h, torch.zeros_like(h)) + h @ self.bias(bucket).squeeze(-1)


def test_t5_min_and_max_with_a_tensor_match_eager():
    torch.manual_seed(0)
    model, x = T5Style().double(), torch.randn(4, 6, dtype=torch.float64)
    eg = export_graph(model, (x,))
    assert {"aten.min.other", "aten.max.other"} <= {n.op for n in eg.graph.nodes}
    gm = graph_model(*over_the_wire(eg, "json"), dtype=torch.float64)
    out, got = grads(gm, x)
    want_out, want = grads(model, x)
    assert torch.allclose(out, want_out, rtol=0, atol=1e-12)
    assert_grads_close(got, want, 1e-12)


class NoGradBlocks(nn.Module):
    """Statistics taken under no_grad, a detached copy, set_grad_enabled(False) with enable_grad inside it,
    and autocast(enabled=False): only the paths eager differentiates carry gradient (`blocks` False: the
    same code differentiated everywhere, the control)."""

    def __init__(self, blocks: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # (batch, 4)
        with torch.no_grad() if self.blocks else contextlib.nullcontext():
            centre = h.mean(-1, keepdim=True)
            teacher = self.b(h)  # no gradient to b from here, nor to a
        y = h - centre + 2 * (h.detach() if self.blocks else h)
        with torch.set_grad_enabled(not self.blocks):
            with torch.enable_grad():
                y = y + 3 * h
        with torch.autocast("cpu", enabled=False):
            y = y + 1
        return self.b(y) * teacher  # (batch, 3)


def test_no_grad_blocks_and_detach_give_eager_gradients():
    torch.manual_seed(0)
    model, x = NoGradBlocks().double(), torch.randn(3, 4, dtype=torch.float64)
    eg = export_graph(model, (x,))
    gm = graph_model(*over_the_wire(eg, "msgpack"), dtype=torch.float64)
    out, got = grads(gm, x)
    want_out, want = grads(model, x)
    assert torch.allclose(out, want_out, rtol=0, atol=1e-12)
    assert_grads_close(got, want, 1e-12)
    control = copy.deepcopy(model)
    control.blocks = False
    assert not torch.allclose(grads(control, x)[1]["a.weight"], want["a.weight"])  # the blocks matter


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(x).float()


def test_an_autocast_block_is_refused_saying_why_and_what_to_do():
    from gradclient.errors import UnsupportedModuleError

    with pytest.raises(UnsupportedModuleError) as err:
        export_graph(Autocast(), (torch.randn(3, 4),))
    message = str(err.value)
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in message
    assert "mixed precision" in message and "Remove the autocast block" in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_neural_ode_with_an_rk4_solver_writing_its_trajectory_in_place_matches_eager(dtype):
    """Its trajectory is a preallocated tensor written through views (select, copy_): the numerical check's
    rounding pass must keep a view a view, or the writes miss the trajectory and the loss has no gradient."""
    import msgspec

    from gradclient.tensors import from_wire, to_wire
    from gradsvc.engine import EngineConfig, compute
    from gradsvc.wire import GradientRequest

    from tests.support.models import NeuralODE

    torch.manual_seed(0)
    model = NeuralODE().to(dtype)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 2, generator=g, dtype=dtype), torch.randn(5, 2, generator=g, dtype=dtype)
    eg = export_graph(model, (x,))
    raw = {"model": {"graph": eg.graph, "dtype": str(dtype).removeprefix("torch."),
                     "weights": {k: to_wire(v, "msgpack") for k, v in eg.weights.items()}},
           "inputs": to_wire(x, "msgpack"), "targets": to_wire(y, "msgpack"), "loss": "mse",
           "options": {"numcheck": "auto"}}
    result = compute(msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=GradientRequest), EngineConfig())
    nn.functional.mse_loss(model(x), y).backward()
    got = {n: torch.as_tensor(from_wire(result.gradients[n])) for n, _ in model.named_parameters()}
    assert_grads_close(got, {n: p.grad for n, p in model.named_parameters()}, 1e-5 if dtype == torch.float32 else 1e-10)
    assert result.numcheck.passed, result.numcheck
