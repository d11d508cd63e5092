"""Several inputs in process: by position and by name, batched or not; what splits them (micro-batches,
per-example gradients) and what is refused, each against local autograd."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradclient.export import example_inputs, export_graph
from gradclient.tensors import from_wire, inputs_to_wire, to_wire
from gradsvc.engine import EngineConfig, SpecError, compute, prepare
from gradsvc.wire import GradientRequest


class Scaled(nn.Module):
    """x (batch, 4) and a scale (4,) shared by every example (no batch dimension)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x, scale):
        return self.b(torch.tanh(self.a(x * scale)))  # (batch, 3)


class Flat(nn.Module):
    """(batch, seq) token ids -> every position's logits flattened to (batch*seq, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 5)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids))).flatten(0, 1)


def over_the_wire(req: GradientRequest) -> GradientRequest:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=GradientRequest)


def request(model, inputs, targets, loss="cross_entropy", **options) -> GradientRequest:
    args, kwargs = example_inputs(inputs)
    eg = export_graph(model, args, kwargs)
    body = {"model": {"graph": eg.graph, "dtype": "float64", "weights": {k: to_wire(v) for k, v in eg.weights.items()}},
            "inputs": inputs_to_wire(inputs), "loss": loss, "options": {"numcheck": "off", **options}}
    if targets is not None:
        body["targets"] = to_wire(targets)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def local(model, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss_fn().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def close(result, want, tol=1e-10) -> None:
    for n, g in want.items():
        got = from_wire(result.gradients[n])
        assert float((got - g).abs().max()) <= tol * max(float(g.abs().max()), 1e-30), n


@pytest.fixture()
def scaled():
    torch.manual_seed(0)
    model = Scaled().double()
    x, scale, y = torch.randn(5, 4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5, \
        torch.randint(0, 3, (5,))
    return model, x, scale, y


def test_an_unbatched_input_goes_whole_to_every_micro_batch_and_example(scaled):
    model, x, scale, y = scaled
    want = local(model, lambda: F.cross_entropy(model(x, scale), y))
    req = request(model, (x, scale), y, micro_batch=2, per_sample="full")
    assert [i.batch_dim for i in req.model.graph.inputs if i.kind == "input"] == [0, None]
    result = compute(req, EngineConfig())
    assert result.micro_batches == 3
    close(result, want)
    per = {n: from_wire(g) for n, g in result.per_sample.gradients.items()}
    for i in range(5):  # example i alone, the scale whole
        one = local(model, lambda: F.cross_entropy(model(x[i:i + 1], scale), y[i:i + 1]))
        for n, g in one.items():
            assert torch.allclose(per[n][i], g, atol=1e-12), (n, i)


def test_inputs_by_name_equal_inputs_by_position(scaled):
    model, x, scale, y = scaled
    by_name = compute(request(model, {"x": x, "scale": scale}, y), EngineConfig())
    by_position = compute(request(model, [x, scale], y), EngineConfig())
    assert {n: from_wire(g).tolist() for n, g in by_name.gradients.items()} == \
        {n: from_wire(g).tolist() for n, g in by_position.gradients.items()}


@pytest.mark.parametrize("inputs, says", [
    (lambda x, s: [to_wire(x)], "a list of 1 tensors, but the graph takes 2 inputs (x, scale)"),
    (lambda x, s: {"x": to_wire(x)}, "'scale' is missing"),
    (lambda x, s: {"x": to_wire(x), "scale": to_wire(s), "mask": to_wire(s)}, "'mask' is not an input"),
    (lambda x, s: to_wire(x), "one tensor, but the graph takes 2 inputs"),
])
def test_inputs_that_do_not_match_the_graph_are_bad_tensor_naming_them(scaled, inputs, says):
    model, x, scale, y = scaled
    req = request(model, (x, scale), y)
    req = over_the_wire(msgspec.structs.replace(req, inputs=inputs(x, scale)))
    with pytest.raises(SpecError) as err:
        prepare(req, EngineConfig())
    assert err.value.code == "bad_tensor" and says in err.value.message, err.value.message


def test_batched_inputs_of_different_batch_sizes_are_refused():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 2)

        def forward(self, u, v):
            return self.a(u) + self.a(v)

    u, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    req = request(Two().double(), (u, v), torch.randint(0, 2, (4,)))
    req = over_the_wire(msgspec.structs.replace(req, inputs=[to_wire(u), to_wire(v[:3])]))
    with pytest.raises(SpecError) as err:
        prepare(req, EngineConfig())
    assert err.value.code == "bad_tensor" and "batch size 3 differs from inputs[0]'s 4" in err.value.message


def test_every_position_targets_split_seq_rows_per_example():
    torch.manual_seed(0)
    model = Flat().double()
    ids, y = torch.randint(0, 7, (3, 4)), torch.randint(0, 5, (12,))
    want = local(model, lambda: F.cross_entropy(model(ids), y))
    prep = prepare(request(model, ids, y, micro_batch=1), EngineConfig())
    assert prep.rows_per_example == 4
    result = compute(request(model, ids, y, micro_batch=1), EngineConfig())
    assert result.micro_batches == 3
    close(result, want)


def test_a_split_is_refused_where_the_outputs_rows_do_not_follow_the_batch():
    class Transposed(nn.Module):  # (batch, seq) -> (seq*batch, 5): rows interleave the examples
        def __init__(self) -> None:
            super().__init__()
            self.inner = Flat()

        def forward(self, ids):
            return self.inner(ids.T.contiguous())

    ids, y = torch.randint(0, 7, (3, 4)), torch.randint(0, 5, (12,))
    with pytest.raises(SpecError) as err:
        prepare(request(Transposed().double(), ids, y, micro_batch=1), EngineConfig())
    assert err.value.code == "bad_option" and "options.micro_batch" in err.value.message
