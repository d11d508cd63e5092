"""Spec validation: every refusal carries a code and a message that says how to fix it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.engine.errors import SpecError
from workers.engine.spec import LAYERS, Limits, build, check_shapes, layer_catalogue


def test_parameter_names_equal_nn_sequential_state_dict():
    model = build([{"type": "Linear", "in_features": 4, "out_features": 4},
                   {"type": "Residual", "layers": [{"type": "Linear", "in_features": 4, "out_features": 4},
                                                   {"type": "ReLU"}]},
                   {"type": "Sequential", "layers": [{"type": "LayerNorm", "normalized_shape": 4}]}],
                  limits=Limits(), device="meta")
    local = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.LayerNorm(4)))
    assert list(model.state_dict()) == list(local.state_dict())


def test_seeded_default_init_equals_local_module():
    torch.manual_seed(3)
    model = build([{"type": "Linear", "in_features": 6, "out_features": 8}], limits=Limits())
    torch.manual_seed(3)
    local = nn.Sequential(nn.Linear(6, 8))
    assert torch.equal(model[0].weight, local[0].weight)


def test_rejects_mismatched_in_features_with_a_fix():
    model = build([{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Tanh"},
                   {"type": "Linear", "in_features": 6, "out_features": 3}], limits=Limits(), device="meta")
    with pytest.raises(SpecError) as info:
        check_shapes(model, torch.empty(2, 6, device="meta"))
    assert info.value.code == "shape_mismatch"
    assert info.value.message == ("layer 2 (Linear) expects 6 input features, got 8 from layer 1 (Tanh); "
                                  "set in_features=8")


@pytest.mark.parametrize(
    "spec, code, fragment",
    [
        ({"type": "LSTM"}, "unknown_layer", "unknown type 'LSTM'"),
        ({"type": "__import__"}, "unknown_layer", "unknown type"),
        ({"type": "Linear", "in_features": 2}, "unknown_layer", "missing required argument 'out_features'"),
        ({"type": "Linear", "in_features": -1, "out_features": 2}, "unknown_layer", "in_features=-1 is invalid"),
        ({"type": "Linear", "in_features": 2, "out_features": 2, "device": "cuda"}, "unknown_layer",
         "unknown argument 'device'"),
        ({"type": "Linear", "in_features": 100000, "out_features": 100000}, "too_large", "parameters"),
        ({"type": "ReLU", "inplace": True}, "unknown_layer", "unknown argument 'inplace'"),
    ],
)
def test_rejects_bad_layers(spec, code, fragment):
    with pytest.raises(SpecError) as info:
        build([spec], limits=Limits(max_parameters=1_000_000), device="meta")
    assert info.value.code == code
    assert fragment in info.value.message


def test_nesting_deeper_than_the_limit_is_refused():
    spec = {"type": "ReLU"}
    for _ in range(10):
        spec = {"type": "Sequential", "layers": [spec]}
    with pytest.raises(SpecError) as info:
        build([spec], limits=Limits(max_depth=4), device="meta")
    assert info.value.code == "too_large"


def test_catalogue_lists_every_allowed_layer():
    names = {entry["type"] for entry in layer_catalogue()}
    assert set(LAYERS) | {"Sequential", "Residual"} == names
    for required in ("Linear", "Conv1d", "Conv2d", "MaxPool2d", "AvgPool2d", "Flatten", "ReLU", "LeakyReLU", "GELU",
                     "Tanh", "Sigmoid", "Softmax", "Dropout", "BatchNorm1d", "BatchNorm2d", "LayerNorm", "Embedding"):
        assert required in names
