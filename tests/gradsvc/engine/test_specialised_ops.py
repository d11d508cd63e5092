"""What a two-stage detector calls beyond ATen, recorded so that the job equals local float64 autograd:
torchvision's `nms` (the indices of the boxes it keeps), which the service runs itself from its inputs; a library's
op with no gradient and no Python implementation that reads and answers integers, and the unique family on
integers, held as the constants they were on the batch; a library's op with no Python implementation of its own but
a reference one written with ATen ops in the library (torchvision's `roi_align`), recorded through that. The ops
here are defined as torchvision defines its own: a schema and a CPU kernel (`torch.library.Library`)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from gradclient import through
from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc.engine import Engine, EngineConfig
from gradsvc.engine.errors import SpecError
from gradsvc.engine.graph import library_ops
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest

_LIB = torch.library.Library("gradsvc_tests_boxes", "DEF")
_LIB.define("bucket(Tensor labels, int size) -> Tensor")
_LIB.define("pool_rows(Tensor x, Tensor rows, float scale) -> Tensor")


def _nms(boxes: torch.Tensor, scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression in Python floats: the kept indices, best score first."""
    kept = []
    for i in sorted(range(len(scores)), key=lambda i: -float(scores[i])):
        if all(_iou(boxes[i].tolist(), boxes[j].tolist()) <= threshold for j in kept):
            kept.append(i)
    return torch.tensor(kept, dtype=torch.long)


def _iou(a, b) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


try:
    import torchvision  # noqa: F401  (its own nms where it is installed)
except ImportError:  # torchvision's nms as torchvision defines it: a schema and a CPU kernel
    _TV = torch.library.Library("torchvision", "FRAGMENT")
    _TV.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV.impl("nms", _nms, "CPU")


def pool_rows_reference(x: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """The library's reference implementation of pool_rows, with ATen ops: each pair of rows' mean, scaled."""
    return (x[rows[:, 0]] + x[rows[:, 1]]) * (scale / 2)


_LIB.impl("bucket", lambda labels, size: labels // size, "CPU")
_LIB.impl("pool_rows", lambda x, rows, scale: pool_rows_reference(x.detach(), rows, scale), "CPU")


def _boxes(raw: torch.Tensor) -> torch.Tensor:
    return torch.cat([raw[:, :2], raw[:, :2] + raw[:, 2:].abs() + 0.5], 1).detach()


class Detector(nn.Module):
    """Scores and boxes from features, the overlapping ones suppressed (torchvision's nms), the kept ones grouped by
    a library's integer op and `torch.unique`, each group's mean scored: a detector's proposals, sampled, pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.box, self.head = nn.Linear(4, 1), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x, classes):
        scores = self.score(x).squeeze(1)
        keep = torch.ops.torchvision.nms(_boxes(self.box(x)), scores.detach(), 0.2)
        ids, inverse = torch.unique(torch.ops.gradsvc_tests_boxes.bucket(classes[keep], 2), return_inverse=True)
        pooled = torch.zeros(len(ids), 4, dtype=x.dtype).index_add(0, inverse, torch.tanh(x[keep] * scores[keep, None]))
        return self.head(pooled).sum() + (scores[keep] ** 2).sum()


def _body(model: nn.Module, inputs: list[torch.Tensor]) -> tuple[object, dict]:
    eg = export_graph(model, tuple(inputs))
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": [to_wire(x) for x in inputs], "loss": "output", "options": {"numcheck": "exact"}}
    return eg, body


def _equals_local(model: nn.Module, body: dict, want: tuple) -> None:
    result = Engine(EngineConfig()).compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest))
    for (n, _), g in zip(model.named_parameters(), want):
        got = decode(result.gradients[n], where=n, max_elements=1 << 20)
        torch.testing.assert_close(got, g, rtol=1e-10, atol=1e-12)
    assert result.numcheck.passed is True, result.numcheck.reason


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nms_runs_in_the_service_and_integer_ops_are_held_and_the_job_equals_local_float64_autograd(seed):
    torch.manual_seed(seed)
    model = Detector().double()
    x, classes = torch.randn(12, 4, dtype=torch.float64), torch.randint(0, 3, (12,))
    kept = len(_nms(_boxes(model.box(x)), model.score(x).squeeze(1).detach(), 0.2))
    assert 1 < kept < 12, kept  # some suppressed, some kept: the indices matter
    want = torch.autograd.grad(model(x, classes), list(model.parameters()), materialize_grads=True)
    eg, body = _body(model, [x, classes])
    ops = {n.op for n in eg.graph.nodes}
    assert eg.capture == "trace" and not any("gradsvc_tests" in o or "unique" in o for o in ops), ops
    nms, = [n for n in eg.graph.nodes if n.op == "torchvision.nms.default"]
    assert nms.shape == [kept], nms.shape
    held = sorted(k for k in eg.graph.constants if k.startswith("c_specialised"))
    assert len(held) == 4, held  # bucket; unique: its values, inverse and counts
    _equals_local(model, body, want)


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        rows = torch.tensor([[0, 1], [2, 5], [4, 4]])
        return torch.sigmoid(torch.ops.gradsvc_tests_boxes.pool_rows(self.lin(x), rows, 3.0)).sum()


def test_a_librarys_op_with_a_reference_implementation_is_recorded_through_it(monkeypatch):
    monkeypatch.setitem(through.REFERENCE_IMPLEMENTATIONS, "gradsvc_tests_boxes::pool_rows",
                        (__name__, "pool_rows_reference"))
    torch.manual_seed(0)
    model, x = Pooled().double(), torch.randn(6, 4, dtype=torch.float64)
    want = torch.autograd.grad(torch.sigmoid(pool_rows_reference(model.lin(x), torch.tensor([[0, 1], [2, 5], [4, 4]]),
                                                                 3.0)).sum(), list(model.parameters()))
    eg, body = _body(model, [x])
    ops = {n.op for n in eg.graph.nodes}
    assert eg.capture == "trace" and "aten.index.Tensor" in ops and not any("pool_rows" in o for o in ops), ops
    _equals_local(model, body, want)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_services_nms_keeps_what_greedy_suppression_keeps_with_ties_and_empty_input(seed):
    g = torch.Generator().manual_seed(seed)
    boxes = _boxes(torch.rand(200, 4, generator=g, dtype=torch.float64) * 10)
    scores = torch.randint(0, 20, (200,), generator=g).double()  # many ties: the first in the input goes first
    for threshold in (0.0, 0.3, 0.7):
        torch.testing.assert_close(library_ops.nms(boxes, scores, threshold), _nms(boxes, scores, threshold))
        torch.testing.assert_close(library_ops.nms(boxes.float(), scores.float(), threshold),
                                   _nms(boxes.float(), scores.float(), threshold))
    assert library_ops.nms(boxes[:0], scores[:0], 0.5).tolist() == []


def test_nms_in_a_graph_that_does_not_say_its_size_is_refused_with_what_to_add():
    torch.manual_seed(0)
    model, x, classes = Detector().double(), torch.randn(12, 4, dtype=torch.float64), torch.randint(0, 3, (12,))
    _, body = _body(model, [x, classes])
    for node in body["model"]["graph"].nodes:
        if node.op == "torchvision.nms.default":
            node.shape = None
    with pytest.raises(SpecError) as err:
        Engine(EngineConfig()).compute(msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest))
    assert err.value.code == "bad_option" and "'shape'" in str(err.value), err.value
