"""Op classes public models call that graphs once refused, each through both capture paths (torch.export, and the
recording of the forward as it runs), equal to local float64 autograd: an alias of an allowed op (`multiply`,
`clip`), a split into sections or at indices (`tensor_split`: state-space and hybrid layers), the deprecated but
everywhere `nn.utils.weight_norm` (`_weight_norm`), in-place scatter and index writes (torch_geometric's softmax
over edges and its aggregations: `scatter_reduce_`, `index_copy_`), a draw (`exponential_`), a float32 RNN
recorded on a CPU (its portable ops, not oneDNN's `mkldnn_rnn_layer`) and routing by `torch.where(mask)`."""

from __future__ import annotations

import copy
import warnings

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc.engine import Engine, EngineConfig
from gradsvc.engine.graph.interpreter import UNREAD
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest

from tests.support.functions import RoundStraightThrough, Scaled


class Aliases(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        return torch.clip(torch.multiply(self.lin(x), self.scale), -0.8, 0.8).sum(dim=1)


class Sections(nn.Module):
    """A Mamba-style projection split into its parts, at indices and into equal sections."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 9)

    def forward(self, x):
        a, b, c = torch.tensor_split(self.proj(x), [2, 5], dim=1)  # (batch, 2), (batch, 3), (batch, 4)
        d, e, f = torch.tensor_split(c.repeat(1, 3)[:, :9], 3, dim=1)  # three of (batch, 3)
        return a.sum(1) * b.mean(1) + torch.tanh(d * e + f).sum(1)


class WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # weight_norm is deprecated, and in every WaveNet and vocoder
            self.lin = nn.utils.weight_norm(nn.Linear(4, 5))
        self.out = nn.Linear(5, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x))).squeeze(1)


class EdgeSoftmax(nn.Module):
    """A graph attention layer's softmax over each node's incoming edges (torch_geometric's utils.softmax), then
    the messages summed per node with index_copy_ into a fresh buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.att = nn.Linear(4, 1)
        self.msg = nn.Linear(4, 4)
        self.register_buffer("dst", torch.tensor([0, 0, 1, 2, 2, 2, 3, 1]))

    def forward(self, x):  # (edges, 4): one row per edge
        score = self.att(x).squeeze(1)  # (edges,)
        top = score.new_zeros(4).scatter_reduce_(0, self.dst, score, reduce="amax", include_self=False)
        e = torch.exp(score - top[self.dst])
        den = score.new_zeros(4).scatter_reduce_(0, self.dst, e, reduce="sum", include_self=False)
        alpha = e / den[self.dst]  # (edges,)
        per_node = x.new_zeros(4, 4).index_add(0, self.dst, alpha.unsqueeze(1) * self.msg(x))  # (nodes, 4)
        firsts = x.new_zeros(8, 4).index_copy_(0, torch.arange(4), per_node)  # (edges, 4): nodes in the first rows
        return (firsts * x).sum(1)


class FilledBySetitem(nn.Module):
    """A linear recurrence scanned into preallocated outputs, as linear-attention kernels write it (transformers'
    reference gated delta rule): `out = torch.zeros_like(h)`, then `out[:, i] = ...` step by step, the state a
    zeros tensor updated each step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        out = torch.zeros_like(h)
        state = torch.zeros(x.shape[0], 4, dtype=x.dtype)
        for i in range(4):
            out[:, i] = (h[:, i:i + 1] * state).sum(-1) + h[:, i]
            state = 0.5 * state + h
        return out.sum(1)


class BatchNormed(nn.Module):
    """BatchNorm in train mode: the recording keeps native_batch_norm, which updates the running statistics in
    place and saves them for backward, and names each updated buffer as an `alias` of itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.lin(x)))).squeeze(1)


class WrittenAfterDetach(nn.Module):
    """A stop-gradient's value written in place with values that train, as torchvision's detection heads fill their
    detached proposals: the check holds the detached value, and each evaluation must write a copy of it, not the
    value an earlier evaluation wrote (whose graph that evaluation's backward freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor([0.5, 1.5, 2.0]))

    def forward(self, x):
        b = (self.lin(x) * 2).detach()
        b[:, 1] = torch.tanh(self.scale[1] * x[:, 1])
        return (b * self.scale).sum(1) + self.lin(x).sum(1)


class TargetsFromDetached(nn.Module):
    """A target made from a stop-gradient's value through large values without a gradient, as Mask R-CNN makes its
    mask targets (roi_align's decomposition samples the ground truth at the detached proposals, 64 x 64 points a
    bin): the check holds them all, and keeps only what a step with a gradient reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("mix", torch.full((3, 3), 1 / 3))

    def forward(self, x):
        h = self.lin(x)
        grid = h.detach().unsqueeze(-1) * torch.linspace(0, 1, 4096, dtype=x.dtype)  # (rows, 3, 4096)
        target = (grid.sin() + grid).mean(-1) @ self.mix  # a matmul at the end (its input not kept), as DSA's indexer
        return ((h - target) ** 2).sum(1)


CASES = {"aliases": (Aliases, 6), "sections": (Sections, 6), "weight_norm": (WeightNormed, 6),
         "edge_softmax": (EdgeSoftmax, 8), "filled_by_setitem": (FilledBySetitem, 5), "batch_norm": (BatchNormed, 6),
         "written_after_detach": (WrittenAfterDetach, 6), "targets_from_detached": (TargetsFromDetached, 6)}
FLOAT32 = ("batch_norm", "written_after_detach", "targets_from_detached")  # whose float64 copy runs more than once


def _request(model: nn.Module, x: torch.Tensor, y: torch.Tensor, capture: str) -> tuple[str, GradientRequest]:
    eg = export_graph(model, (x,), recorded_because="the test asks for the recording" if capture == "trace" else None)
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "mse", "options": {"numcheck": "exact"}}
    return eg.capture, msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def _computed(body: dict, params: dict, want) -> object:
    """`body` computed by the engine through its wire form (as the API hands it over): each parameter's gradient
    equal to `want`, local float64 autograd's, and the numerical check passed. Answers the result."""
    result = Engine(EngineConfig()).compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest))
    for (n, _), g in zip(params.items(), want):
        torch.testing.assert_close(decode(result.gradients[n], where=n, max_elements=1 << 20), g, rtol=1e-9, atol=1e-12)
    assert result.numcheck.passed is True, result.numcheck.reason
    return result


@pytest.mark.parametrize("capture", ["export", "trace"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_op_class_runs_and_equals_local_float64_autograd(name, capture):
    cls, rows = CASES[name]
    torch.manual_seed(0)
    model = cls().double()
    x, y = torch.randn(rows, 4, dtype=torch.float64), torch.randn(rows, dtype=torch.float64)
    params = dict(model.named_parameters())
    want = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), list(params.values()))
    how, request = _request(model, x, y, capture)
    if name == "weight_norm":  # its pre-hook assigns lin.weight in forward, which export refuses: always recorded
        assert how == "trace", how
    else:
        assert how == capture or capture == "export" and how == "export_static", how
    result = Engine(EngineConfig()).compute(request)
    for (n, _), g in zip(params.items(), want):
        got = decode(result.gradients[n], where=n, max_elements=1 << 20)
        torch.testing.assert_close(got, g, rtol=1e-10, atol=1e-12)
    assert result.numcheck.passed is True, result.numcheck.reason


@pytest.mark.parametrize("capture", ["export", "trace"])
def test_held_values_only_held_steps_read_are_not_kept_between_evaluations(capture):
    torch.manual_seed(0)
    model = TargetsFromDetached().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    _, request = _request(model, x, y, capture)
    graph = copy.deepcopy(Engine(EngineConfig()).prepare(request, "cpu").model)
    graph.hold()
    first = graph(x)  # the recording forward
    kept = [v for v in graph.held.values() if v is not UNREAD]
    assert len(graph.held) >= 4 and len(kept) == 1, graph.held  # the target alone: the one value `h - target` reads
    assert kept[0].numel() == 6 * 3
    torch.testing.assert_close(graph(x), first, rtol=0, atol=0)  # a later forward replays it
    with torch.no_grad():
        graph.lin.bias.add_(1.0)  # the held target stays the recorded one while the parameters move
        want = ((model.lin(x) + 1.0 - kept[0]) ** 2).sum(1)
    torch.testing.assert_close(graph(x), want, rtol=1e-12, atol=1e-12)


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = self.lin(x)
        return (h * torch.empty_like(h).exponential_()).sum(1)  # exponential noise, as a Gumbel trick draws it


@pytest.mark.parametrize("capture", ["export", "trace"])
@pytest.mark.parametrize("name", FLOAT32)
def test_a_float32_job_is_checked_through_every_float64_evaluation(name, capture):
    # The check's float64 copy runs forward and backward again for the returned gradients' tolerance (a rounding
    # simulation): neither a write-back of a buffer the op saved, nor a held value written in an earlier
    # evaluation, may break that second backward (passed null: "the numerical check failed inside"), nor may its
    # hooks read a held value that was not kept
    cls, rows = CASES[name]
    torch.manual_seed(0)
    model = cls()
    x, y = torch.randn(rows, 4), torch.randn(rows)
    params = dict(model.named_parameters())
    m64 = copy.deepcopy(model).double()
    want = torch.autograd.grad(F.mse_loss(m64(x.double()), y.double()), list(m64.parameters()))
    eg = export_graph(model, (x,), recorded_because="the test asks for the recording" if capture == "trace" else None)
    body = {"model": {"graph": eg.graph, "dtype": "float32", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "mse", "options": {"numcheck": "exact"}}
    result = Engine(EngineConfig()).compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest))
    for (n, _), g in zip(params.items(), want):
        got = decode(result.gradients[n], where=n, max_elements=1 << 20).double()
        torch.testing.assert_close(got, g, rtol=1e-5, atol=1e-6)
    assert result.numcheck.passed is True, result.numcheck.reason


class TiedMask(nn.Module):
    """Intersections as torchvision's box losses compute them (FCOS's GIoU): a mask of the positive ones selects
    rows. At initialisation many boxes are degenerate: x2 == x1 exactly, the comparison a tie."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        p = self.lin(x)
        x1, x2 = p[:, 0], torch.maximum(p[:, 0], p[:, 1])  # x2 == x1 wherever p1 <= p0
        mask = x2 > x1
        inter = torch.zeros_like(x1)
        inter[mask] = (x2[mask] - x1[mask]) ** 2
        return inter + torch.tanh(x1)


def test_a_float32_jobs_check_takes_a_tied_comparison_as_float64_did():
    # The rounding simulation moves x2 and x1 apart where they tie, which would change the mask, the rows it
    # selects and the shapes after it ("its output has shape [9] ... the capture had [2]": the check failed
    # inside); the comparisons are held as the float64 forward took them
    torch.manual_seed(0)
    model = TiedMask()
    x, y = torch.randn(32, 4), torch.randn(32)
    eg = export_graph(model, (x,), recorded_because="the test asks for the recording")
    body = {"model": {"graph": eg.graph, "dtype": "float32", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "mse", "options": {"numcheck": "exact"}}
    result = Engine(EngineConfig()).compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest))
    m64 = copy.deepcopy(model).double()
    want = torch.autograd.grad(F.mse_loss(m64(x.double()), y.double()), list(m64.parameters()))
    for (n, _), g in zip(model.named_parameters(), want):
        torch.testing.assert_close(decode(result.gradients[n], where=n, max_elements=1 << 20).double(), g,
                                   rtol=1e-5, atol=1e-6)
    assert result.numcheck.passed is True, result.numcheck.reason


@pytest.mark.parametrize("capture", ["export", "trace"])
def test_a_draw_in_place_runs_from_the_jobs_seed_and_is_checked(capture):
    torch.manual_seed(0)
    model = Noisy().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    _, request = _request(model, x, y, capture)
    first, again = (Engine(EngineConfig()).compute(request) for _ in range(2))
    assert first.numcheck.passed is True, first.numcheck.reason
    assert first.loss == again.loss  # the same draws: the job's seed


class Experts(nn.Module):
    """A Mixture-of-Experts layer as transformers 5 writes it: tokens sorted by their routed expert, torch's grouped
    matmul over the experts' weights with the groups' end offsets, then put back in order. `loop` computes the same
    with one matmul per expert (the answer key: torch's kernel has no float64 and, on a CPU, no backward)."""

    def __init__(self, loop: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(8, 3)
        self.w = nn.Parameter(torch.randn(3, 8, 4) / 3)
        self.loop = loop

    def forward(self, x):  # (tokens, 8)
        expert = self.router(x).argmax(dim=1)  # (tokens,)
        order = torch.argsort(expert, stable=True)
        offs = torch.bincount(expert, minlength=3).cumsum(0).to(torch.int32)  # (experts,): each group's end
        xs = x[order] * torch.softmax(self.router(x), dim=1).max(dim=1).values[order].unsqueeze(1)
        if self.loop:
            ends = offs.tolist()
            ys = torch.cat([xs[s:e] @ self.w[g] for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])
        else:
            ys = torch._grouped_mm(xs, self.w, offs=offs)  # (tokens, 4)
        return ys[torch.argsort(order)].sum(dim=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_grouped_matmul_of_experts_equals_one_matmul_per_expert_in_float64(seed):
    torch.manual_seed(seed)
    model = Experts()
    x, y = torch.randn(10, 8), torch.randn(10)
    eg = export_graph(model, (x,), recorded_because="torch._grouped_mm has no backward on this CPU")
    assert any(n.op == "aten._grouped_mm.default" for n in eg.graph.nodes)
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "mse", "options": {"numcheck": "exact"}}
    result = Engine(EngineConfig()).compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest))
    key = Experts(loop=True).double()
    key.load_state_dict(model.state_dict())
    params = dict(key.named_parameters())
    want = torch.autograd.grad(torch.nn.functional.mse_loss(key(x.double()), y.double()), list(params.values()))
    for (n, _), g in zip(params.items(), want):
        torch.testing.assert_close(decode(result.gradients[n], where=n, max_elements=1 << 20), g, rtol=1e-10, atol=1e-12)
    assert result.numcheck.passed is True, result.numcheck.reason


class CTCTagger(nn.Module):
    """A speech model's CTC loss (an op with no meta kernel: the shape check takes its output's sizes from its
    arguments')."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x, targets):  # (batch, frames, 4), (batch, 3)
        log_probs = torch.log_softmax(self.proj(x), dim=-1).transpose(0, 1)  # (frames, batch, classes)
        frames = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        lengths = (targets > 0).sum(dim=1)  # label 0 is the blank: padding
        return nn.functional.ctc_loss(log_probs, targets, frames, lengths)


class CTCConcatenated(CTCTagger):
    """CTC over the labels concatenated, as Hugging Face's CTC heads pass them: `labels.masked_select(labels >= 0)`
    (integer values picked by a mask: the graph carries their size) with each row's length."""

    def forward(self, x, labels):  # labels (batch, 3), -100 where a row is shorter
        log_probs = torch.log_softmax(self.proj(x), dim=-1).transpose(0, 1)
        frames = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        mask = labels >= 0
        return nn.functional.ctc_loss(log_probs, labels.masked_select(mask), frames, mask.sum(-1))


CTC_LABELS = {"padded": (CTCTagger, [[1, 2, 3], [4, 5, 0], [2, 2, 1]]),
              "concatenated": (CTCConcatenated, [[1, 2, 3], [4, 5, -100], [2, -100, -100]])}


@pytest.mark.parametrize("capture", ["export", "trace"])
@pytest.mark.parametrize("labels", list(CTC_LABELS))
def test_a_ctc_loss_passes_the_shape_check_and_equals_local_float64_autograd(labels, capture):
    cls, rows = CTC_LABELS[labels]
    torch.manual_seed(0)
    model = cls().double()
    x, targets = torch.randn(3, 9, 4, dtype=torch.float64), torch.tensor(rows)
    params = dict(model.named_parameters())
    want = torch.autograd.grad(model(x, targets), list(params.values()))
    eg = export_graph(model, (x, targets), recorded_because="the test asks for the recording" if capture == "trace"
                      else None)
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": [to_wire(x), to_wire(targets)], "loss": "output", "options": {"numcheck": "exact"}}
    _computed(body, params, want)


@torch.library.custom_op("gradsvc_tests::rowwise_mm", mutates_args=())
def rowwise_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A library's own op with a Python implementation (as transformers' grouped_mm_fallback is), writing each
    group's rows with an out= matmul into a buffer it made."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        torch.mm(x[start:end], w[g], out=out[start:end])
        start = end
    return out


@rowwise_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


def _rowwise_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    gx, gw, start = torch.zeros_like(x), torch.zeros_like(w), 0
    for g, end in enumerate(offs.tolist()):
        gx[start:end], gw[g] = grad[start:end] @ w[g].T, x[start:end].T @ grad[start:end]
        start = end
    return gx, gw, None


rowwise_mm.register_autograd(_rowwise_mm_backward,
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class LibraryOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 4, 3, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(rowwise_mm(x, self.w, torch.tensor([2, 5]))).sum(dim=1)


def test_a_librarys_own_op_is_recorded_through_to_aten_with_out_variants_made_functional():
    torch.manual_seed(0)
    model, x, y = LibraryOp(), torch.randn(5, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    eg = export_graph(model, (x,))  # export keeps the op whole, which the service does not run: recorded instead
    assert eg.capture == "trace" and "library op gradsvc_tests::rowwise_mm" in eg.why_not_export, eg.why_not_export
    ops = {n.op for n in eg.graph.nodes}
    assert "aten.mm.default" in ops and not any("rowwise" in o or o.endswith(".out") for o in ops), ops
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "mse", "options": {"numcheck": "exact"}}
    result = Engine(EngineConfig()).compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest))
    want, = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), [model.w])
    torch.testing.assert_close(decode(result.gradients["w"], where="w", max_elements=1 << 20), want, rtol=1e-10,
                               atol=1e-12)
    assert result.numcheck.passed is True, result.numcheck.reason


class BiLSTMTagger(nn.Module):
    """A bidirectional LSTM tagger, recorded as users train it: in float32 on a CPU, where the forward runs oneDNN's
    `mkldnn_rnn_layer` unless the recording turns it off (gradclient/graph.py portable)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 6, batch_first=True, bidirectional=True)
        self.out = nn.Linear(12, 5)

    def forward(self, ids):
        h, _ = self.lstm(self.emb(ids))
        return self.out(h).flatten(0, 1)


@pytest.mark.parametrize("capture", ["export", "trace"])
def test_a_float32_rnn_recorded_on_a_cpu_runs_its_portable_ops_and_equals_local_float64_autograd(capture):
    torch.manual_seed(0)
    model = BiLSTMTagger()
    ids, tags = torch.randint(0, 20, (3, 7)), torch.randint(0, 5, (21,))
    eg = export_graph(model, (ids,), recorded_because="the test asks for the recording" if capture == "trace"
                      else None)
    assert eg.capture == capture and not any("mkldnn" in n.op for n in eg.graph.nodes if getattr(n, "op", None))
    local = model.double()
    params = dict(local.named_parameters())
    want = torch.autograd.grad(torch.nn.functional.cross_entropy(local(ids), tags), list(params.values()))
    body = {"model": {"graph": eg.graph, "dtype": "float64",
                      "weights": {k: to_wire(v.double()) for k, v in eg.weights.items()}},
            "inputs": to_wire(ids), "targets": to_wire(tags), "loss": "cross_entropy", "options": {"numcheck": "exact"}}
    _computed(body, params, want)


class WhereRouted(nn.Module):
    """Experts picked by a data-dependent index, `idx, = torch.where(choice == e)`, as MoE layers route tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList([nn.Linear(4, 2) for _ in range(3)])

    def forward(self, x):
        choice = self.gate(x).argmax(dim=1)
        out = torch.zeros(x.shape[0], 2, dtype=x.dtype)
        for e, expert in enumerate(self.experts):
            idx, = torch.where(choice == e)
            out = out.index_add(0, idx, expert(x[idx]) * torch.softmax(self.gate(x[idx]), 1)[:, e:e + 1])
        return out.sum(1)


@pytest.mark.parametrize("seed", [0, 1])
def test_routing_by_torch_where_is_recorded_with_its_sizes_and_equals_local_float64_autograd(seed):
    """Export leaves one-argument `where` with sizes it cannot know (`aten.where.default`, refused); the SDK records
    such a module instead (nonzero, its size carried), and the job equals local autograd on the batch captured."""
    torch.manual_seed(seed)
    model = WhereRouted().double()
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    params = dict(model.named_parameters())
    want = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), list(params.values()))
    eg = export_graph(model, (x,))
    ops = {n.op for n in eg.graph.nodes if getattr(n, "op", None)}
    assert eg.capture == "trace" and "aten.nonzero.default" in ops and "aten.where.default" not in ops, ops
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "mse", "options": {"numcheck": "exact"}}
    _computed(body, params, want)


class EMACodebook(nn.Module):
    """A VQ-VAE quantizer whose codebook trains by EMA, as public code writes it: the buffers updated through
    `.data` in forward, then read by the same forward (the straight-through estimator over the updated codes)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 3)
        self.register_buffer("codebook", torch.randn(5, 3))
        self.register_buffer("count", torch.ones(5))

    def forward(self, x):
        z = self.enc(x)
        onehot = torch.nn.functional.one_hot(torch.cdist(z, self.codebook).argmin(1), 5).to(z.dtype)
        with torch.no_grad():
            self.count.data.mul_(0.9).add_(onehot.sum(0), alpha=0.1)
            self.codebook.data.mul_(0.9).add_(onehot.t() @ z, alpha=0.1)
        q = onehot @ self.codebook
        q = z + (q - z).detach()
        return (q ** 2).sum(1) + ((z - q.detach()) ** 2).sum(1)


@pytest.mark.parametrize("seed", [0, 1])
def test_an_ema_codebook_written_through_data_runs_as_eager_and_returns_the_written_buffers(seed):
    """The writes through `.data` are the buffers' own (read after by the same forward, returned as the buffers
    the forward wrote); gradients, loss and buffers equal eager float64 on the module."""
    torch.manual_seed(seed)
    model = EMACodebook().double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    eg = export_graph(model, (x,))
    local = copy.deepcopy(model)  # the capture put the module back as it found it
    params = dict(local.named_parameters())
    loss = torch.nn.functional.mse_loss(local(x), y)
    want = torch.autograd.grad(loss, list(params.values()))
    body = {"model": {"graph": eg.graph, "dtype": "float64",
                      "weights": {k: to_wire(model.state_dict()[k]) for k in eg.weights}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "mse", "options": {"numcheck": "exact"}}
    result = _computed(body, params, want)
    assert result.loss == pytest.approx(float(loss), rel=1e-12)
    for n, b in local.named_buffers():  # the values eager's forward wrote
        torch.testing.assert_close(decode(result.buffers[n], where=n, max_elements=1 << 20), b, rtol=1e-12, atol=1e-12)


class _ScaledReshape(torch.autograd.Function):
    """A Function taking a Size and a dict besides its tensors (which an exported graph cannot carry), its backward
    the true derivative."""

    @staticmethod
    def forward(ctx, x, w, shape, opts):
        ctx.save_for_backward(x, w)
        ctx.shape, ctx.scale = x.shape, opts["scale"]
        return (x * w * opts["scale"]).reshape(shape)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.reshape(ctx.shape) * ctx.scale
        return g * w, (g * x).sum(0), None, None


class FunctionTakingSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return _ScaledReshape.apply(h, self.w, torch.Size([x.shape[0] * 3]), {"scale": 0.5}).reshape(-1, 3).sum(1)


class FunctionBehindNumpy(nn.Module):
    """A custom Function in a forward neither export nor draft_export captures (a count read through numpy)."""

    def __init__(self, straight_through: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.straight_through = straight_through

    def forward(self, x, lengths):
        import numpy as np

        h = torch.tanh(self.lin(x[:int(np.max(lengths.numpy()))]))
        return (RoundStraightThrough.apply(h) if self.straight_through else Scaled.apply(h, self.w, 2.0)).sum(1)


def _sdk_body(model: nn.Module, inputs: list, y: torch.Tensor) -> dict:
    from gradclient.request import Call, RequestBuilder

    builder = RequestBuilder("msgpack", msgspec.msgpack.Encoder(), ref_min_bytes=64 << 10)
    return builder.prepare(Call(model, inputs, y, loss="mse", seed=0, options={"numcheck": "exact"})).body


def test_a_custom_function_in_a_recorded_forward_is_sent_when_its_backward_is_its_forwards_derivative():
    """The recording holds the Function's forward ops; the SDK holds their derivative against the Function's own
    backward on the batch before it sends it: the right one goes through and equals local float64 autograd, a
    straight-through estimator is refused naming the Function."""
    from gradclient.errors import UnsupportedModuleError

    torch.manual_seed(0)
    model = FunctionBehindNumpy(straight_through=False).double()
    x, lengths, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([3, 5]), torch.randn(5, dtype=torch.float64)
    body = _sdk_body(model, [x, lengths], y)
    assert body["model"]["graph"].capture == "trace"
    params = dict(model.named_parameters())
    want = torch.autograd.grad(torch.nn.functional.mse_loss(model(x, lengths), y), list(params.values()))
    _computed(body, params, want)
    with pytest.raises(UnsupportedModuleError, match="RoundStraightThrough.*straight-through"):
        _sdk_body(FunctionBehindNumpy(straight_through=True).double(), [x, lengths], y)
    sized = FunctionTakingSize().double()  # its Size and dict arguments: no export holds them, the recording does
    body = _sdk_body(sized, x, torch.randn(6, dtype=torch.float64))
    assert body["model"]["graph"].capture == "trace"


class AttentionDropout(nn.Module):
    """Causal self-attention with dropout inside torch's fused op (`dropout_p`), as Hugging Face models call it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True).sum((1, 2, 3))


@pytest.mark.parametrize("capture", ["export", "trace"])
def test_attention_dropout_draws_the_same_masks_in_every_evaluation_of_the_check(capture):
    """sdpa's dropout draws its masks inside the op: the check's forwards draw the same ones (a right gradient
    passes), and the job's seed makes the local forward's masks."""
    torch.manual_seed(0)
    model = AttentionDropout().double().train()
    x, y = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    eg = export_graph(model, (x,), recorded_because="the test asks for the recording" if capture == "trace" else None)
    assert eg.capture == capture or eg.capture == "export_static", eg.capture
    body = {"model": {"graph": eg.graph, "dtype": "float64", "seed": 5,
                      "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": to_wire(x), "targets": to_wire(y), "loss": "mse", "options": {"numcheck": "exact"}}
    params = dict(model.named_parameters())
    torch.manual_seed(5)
    want = torch.autograd.grad(F.mse_loss(model(x), y), list(params.values()))
    _computed(body, params, want)


class MaskedByConstant(nn.Module):
    """A mask made outside torch's ops in forward (a constant of the recording), written in place through a view
    (torch_geometric's SuperGATConv marks its sampled edges so)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        mask = torch.from_numpy(np.array([True, False, False, True]))
        mask[1:].bitwise_or_(self.lin(x).sum(0)[1:] > 0)
        return (self.lin(x) * mask).sum(1)


def test_a_constant_written_in_place_through_a_view_is_each_runs_own_copy():
    torch.manual_seed(0)
    model = MaskedByConstant().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    how, request = _request(model, x, y, "trace")
    assert how == "trace"
    want = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    engine = Engine(EngineConfig())
    for _ in range(2):  # the check runs the forward many times, and a second job reuses the compiled graph
        result = engine.compute(request)
        for (n, _), g in zip(model.named_parameters(), want):
            torch.testing.assert_close(decode(result.gradients[n], where=n, max_elements=1 << 20), g, rtol=1e-10,
                                       atol=1e-12)
        assert result.numcheck.passed is True, result.numcheck.reason
