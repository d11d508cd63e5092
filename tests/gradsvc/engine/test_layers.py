"""The layer types beyond the first allow-list, through compute(): recurrent dropout seeded like
Dropout, options that cannot split or vmap a layer refused with bad_option, estimates on meta."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsvc.engine import SpecError, compute, estimate
from gradsvc.engine.errors import EngineError
from gradsvc.engine.spec import Limits, build, validate_shapes
from gradsvc.engine.tensors import decode
from gradsvc.modules import LSTM
from gradsvc.wire import GradientRequest

from tests.support.layer_samples import every_argument_value, input_shape
from tests.support.nets import tensor_json

RNN_STACK = [{"type": "LSTM", "input_size": 3, "hidden_size": 4, "num_layers": 2, "dropout": 0.5, "batch_first": True},
             {"type": "Flatten"}, {"type": "Linear", "in_features": 20, "out_features": 2}]


def request(layers, x, y, loss="cross_entropy", **options) -> GradientRequest:
    return msgspec.convert({"model": {"layers": layers, "dtype": "float64", "seed": 7}, "inputs": tensor_json(x),
                            "targets": tensor_json(y), "loss": loss, "options": {"numcheck": "off", **options}},
                           GradientRequest)


def test_recurrent_dropout_is_seeded_so_gradients_equal_local_autograd_and_pass_numcheck():
    x, y = torch.randn(3, 5, 3, dtype=torch.float64), torch.tensor([0, 1, 1])
    result = compute(request(RNN_STACK, x, y, numcheck="directional"))
    torch.manual_seed(7)
    local = nn.Sequential(LSTM(3, 4, num_layers=2, dropout=0.5, batch_first=True), nn.Flatten(), nn.Linear(20, 2))
    local = local.double()
    torch.manual_seed(7)  # the service draws the dropout masks from the request's seed
    loss = F.cross_entropy(local(x), y)
    grads = dict(zip([n for n, _ in local.named_parameters()], torch.autograd.grad(loss, list(local.parameters()))))
    assert result.loss == pytest.approx(loss.item(), abs=1e-12)
    for name, g in grads.items():
        assert torch.allclose(decode(result.gradients[name], where=name, max_elements=1 << 30), g, atol=1e-10), name
    assert result.numcheck.passed, result.numcheck


def test_per_sample_gradients_of_a_recurrent_layer_are_refused_with_bad_option():
    x, y = torch.randn(3, 5, 3, dtype=torch.float64), torch.tensor([0, 1, 1])
    with pytest.raises(SpecError) as info:
        compute(request(RNN_STACK, x, y, per_sample="norms"))
    assert info.value.code == "bad_option"
    assert "layer 0 (LSTM) cannot run under torch.func.vmap" in info.value.message
    embedding = [{"type": "Embedding", "num_embeddings": 5, "embedding_dim": 3, "max_norm": 0.5}, {"type": "Flatten"},
                 {"type": "Linear", "in_features": 6, "out_features": 2}]
    with pytest.raises(SpecError, match=r"layer 0 \(Embedding\) cannot run under torch.func.vmap"):
        compute(request(embedding, torch.tensor([[1, 2], [3, 4]]), y[:2], per_sample="norms"))


def test_micro_batches_of_a_sequence_first_layer_are_refused_naming_batch_first():
    layers = [{"type": "TransformerEncoderLayer", "d_model": 4, "nhead": 2, "dim_feedforward": 8, "dropout": 0.0},
              {"type": "Flatten"}, {"type": "Linear", "in_features": 12, "out_features": 2}]
    x, y = torch.randn(4, 3, 4, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    with pytest.raises(SpecError) as info:
        compute(request(layers, x, y, micro_batch=2))
    assert info.value.code == "bad_option"
    assert "set batch_first=true" in info.value.message
    layers[0]["batch_first"] = True
    whole, split = compute(request(layers, x, y)), compute(request(layers, x, y, micro_batch=2))
    for name, g in whole.gradients.items():
        a = decode(g, where=name, max_elements=1 << 30)
        b = decode(split.gradients[name], where=name, max_elements=1 << 30)
        assert torch.allclose(a, b, atol=1e-10), name


def test_estimate_runs_batch_norm_with_a_cumulative_average_on_meta():
    body = {"model": {"layers": [{"type": "BatchNorm1d", "num_features": 10, "momentum": None},
                                 {"type": "Linear", "in_features": 10, "out_features": 2}]},
            "inputs": {"dtype": "float32", "shape": [4, 10]}, "targets": {"dtype": "int64", "shape": [4]}}
    est = estimate(msgspec.convert(body, GradientRequest))
    assert est.parameter_count == 20 + 22
    assert [row.type for row in est.memory.layers] == ["BatchNorm1d", "Linear"]


def _one_value_per_argument():
    seen = set()
    for kind, name, spec in every_argument_value():
        if (kind, name) not in seen:
            seen.add((kind, name))
            yield spec


def test_every_accepted_argument_value_computes_or_is_refused_with_a_code():
    """What the table accepts never fails with anything but a coded error when the worker runs it: no
    value that the meta check lets through may raise in the real forward or backward (a 500)."""
    computed = 0
    for i, spec in enumerate(_one_value_per_argument()):
        shape = input_shape(spec["type"])
        x = torch.randint(0, 2, (2, 3)) if shape is None else torch.randn(shape, dtype=torch.float64)
        try:
            out = validate_shapes(build([spec], limits=Limits(), device="meta").double(), x.to("meta"))
        except SpecError as exc:
            assert exc.code == "shape_mismatch", (spec, exc.message)
            continue
        body = {"model": {"layers": [spec], "dtype": "float64"}, "inputs": tensor_json(x),
                "targets": tensor_json(torch.randn(out.shape, dtype=torch.float64)), "loss": "mse",
                "options": {"numcheck": "off", "memory": i % 2 == 0, "input_grad": x.dtype.is_floating_point}}
        try:
            compute(msgspec.convert(body, GradientRequest))
            computed += 1
        except EngineError as exc:
            assert exc.code in ("non_finite", "bad_option"), (spec, exc.message)
    assert computed > 200


def test_input_grad_with_integer_inputs_and_a_model_without_parameters_are_bad_options():
    emb = [{"type": "Embedding", "num_embeddings": 5, "embedding_dim": 3}]
    with pytest.raises(SpecError, match="the inputs are integer indices"):
        compute(request(emb, torch.tensor([[1, 2], [3, 4]]), torch.zeros(2, 2, 3, dtype=torch.float64),
                        input_grad=True, loss="mse"))
    with pytest.raises(SpecError, match="the model has no parameters") as info:
        compute(request([{"type": "ReLU"}], torch.randn(2, 3, dtype=torch.float64), torch.zeros(2, 3)))
    assert info.value.code == "bad_option"
