"""Spec validation: every refusal carries a code and a message that says how to fix it."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from gradsvc.engine.errors import SpecError
from gradsvc.engine.spec import LAYERS, Limits, build, validate_shapes, layer_catalogue
from gradsvc.layers import read_args


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
        validate_shapes(model, torch.empty(2, 6, device="meta"))
    assert info.value.code == "shape_mismatch"
    assert info.value.message == ("layer 2 (Linear) expects 6 input features, got 8 from layer 1 (Tanh); "
                                  "set in_features=8")


@pytest.mark.parametrize(
    "spec, code, fragment",
    [
        ({"type": "LSTMCell"}, "unknown_layer", "unknown type 'LSTMCell'"),
        ({"type": "__import__"}, "unknown_layer", "unknown type"),
        ({"type": "Linear", "in_features": 2}, "unknown_layer", "missing required argument 'out_features'"),
        ({"type": "Linear", "in_features": -1, "out_features": 2}, "unknown_layer", "in_features=-1 is invalid"),
        ({"type": "Linear", "in_features": 2, "out_features": 2, "device": "cuda"}, "unknown_layer",
         "unknown argument 'device'"),
        ({"type": "Linear", "in_features": 100000, "out_features": 100000}, "too_large", "parameters"),
        ({"type": "ReLU", "inplace": 1}, "unknown_layer", "inplace=1 is invalid; expected true or false"),
        ({"type": "Residual", "layers": [{"type": "ReLU", "inplace": True}]}, "unknown_layer",
         "inplace=true inside a Residual"),
        ({"type": "Dropout", "p": 1.5}, "unknown_layer", "p=1.5 is invalid; expected a finite number [0, 1]"),
        ({"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel_size": 3, "groups": 2}, "unknown_layer",
         "groups=2 is invalid; expected a divisor of in_channels=3"),
        ({"type": "Conv1d", "in_channels": 3, "out_channels": 3, "kernel_size": 3, "padding": "same", "stride": 2},
         "unknown_layer", "padding='same' is invalid"),
        ({"type": "GroupNorm", "num_groups": 4, "num_channels": 6}, "unknown_layer", "num_groups=4 is invalid"),
        ({"type": "TransformerEncoderLayer", "d_model": 6, "nhead": 4}, "unknown_layer", "nhead=4 is invalid"),
        ({"type": "LSTM", "input_size": 2, "hidden_size": 3, "proj_size": 3}, "unknown_layer", "proj_size=3 is invalid"),
        ({"type": "Embedding", "num_embeddings": 4, "embedding_dim": 2, "padding_idx": 4}, "unknown_layer",
         "padding_idx=4 is invalid"),
        ({"type": "CELU", "alpha": 0}, "unknown_layer", "alpha=0 is invalid"),
        ({"type": "MaxPool2d", "kernel_size": 2, "return_indices": True}, "unknown_layer",
         "return_indices=True is invalid; expected one of [False]"),
    ],
)
def test_rejects_bad_layers(spec, code, fragment):
    with pytest.raises(SpecError) as info:
        build([spec], limits=Limits(max_parameters=1_000_000), device="meta")
    assert info.value.code == code
    assert fragment in info.value.message


def test_an_invalid_value_names_its_argument_in_the_detail():
    with pytest.raises(SpecError) as info:
        build([{"type": "Linear", "in_features": 2, "out_features": 2},
               {"type": "Sequential", "layers": [{"type": "Softplus", "beta": "big"}]}], limits=Limits(), device="meta")
    assert info.value.detail == {"path": "1.0", "argument": "beta"}


def without_bias(cls: type[nn.Module], n: int) -> nn.Module:
    """cls(n, bias=False) on any admitted torch: the argument is newer than some (BatchNorm's); a layer
    without it has its bias removed, as spec.construct does."""
    if "bias" in inspect.signature(cls.__init__).parameters:
        return cls(n, bias=False)
    layer = cls(n)
    layer.register_parameter("bias", None)
    return layer


# The constructor calls torch's module_db makes that a spec must accept (each built when its test runs).
@pytest.mark.parametrize("spec, local", [
    ({"type": "BatchNorm1d", "num_features": 10, "eps": 0.001, "momentum": None}, lambda: nn.BatchNorm1d(10, 0.001, None)),
    ({"type": "BatchNorm2d", "num_features": 3, "eps": 0.001, "momentum": None}, lambda: nn.BatchNorm2d(3, 0.001, None)),
    ({"type": "BatchNorm1d", "num_features": 10, "bias": False}, lambda: without_bias(nn.BatchNorm1d, 10)),
    ({"type": "BatchNorm2d", "num_features": 3, "bias": False}, lambda: without_bias(nn.BatchNorm2d, 3)),
    ({"type": "AvgPool2d", "kernel_size": [2, 2], "divisor_override": 1}, lambda: nn.AvgPool2d((2, 2), divisor_override=1)),
    ({"type": "AdaptiveAvgPool2d", "output_size": [3, None]}, lambda: nn.AdaptiveAvgPool2d((3, None))),
    ({"type": "Softplus", "beta": 2, "threshold": -100}, lambda: nn.Softplus(2, -100)),
])
def test_accepts_what_torch_accepts_and_builds_the_same_layer(spec, local):
    local = local()
    model = build([spec], limits=Limits())
    assert type(model[0]) is type(local) and read_args(spec["type"], model[0]) == read_args(spec["type"], local)
    assert [(k, v.shape) for k, v in model[0].state_dict().items()] == [(k, v.shape) for k, v in local.state_dict().items()]
    x = torch.randn(4, 10) if spec["type"] == "BatchNorm1d" else torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(model[0](x), local(x), rtol=0, atol=0)


MIXED = [{"type": "Conv1d", "in_channels": 2, "out_channels": 4, "kernel_size": 3, "padding": "same"},
         {"type": "GroupNorm", "num_groups": 2, "num_channels": 4},
         {"type": "PReLU", "num_parameters": 4, "init": 0.1},
         {"type": "Residual", "layers": [{"type": "ConvTranspose1d", "in_channels": 4, "out_channels": 4,
                                          "kernel_size": 3, "padding": 1}]},
         {"type": "LSTM", "input_size": 6, "hidden_size": 5, "batch_first": True, "bidirectional": True},
         {"type": "TransformerEncoderLayer", "d_model": 10, "nhead": 2, "dim_feedforward": 16, "batch_first": True},
         {"type": "RMSNorm", "normalized_shape": 10},
         {"type": "Flatten"}, {"type": "Linear", "in_features": 40, "out_features": 3}]


def _mixed_local() -> nn.Sequential:
    return nn.Sequential(nn.Conv1d(2, 4, 3, padding="same"), nn.GroupNorm(2, 4), nn.PReLU(4, 0.1),
                         nn.Sequential(nn.ConvTranspose1d(4, 4, 3, padding=1)),
                         nn.LSTM(6, 5, batch_first=True, bidirectional=True),
                         nn.TransformerEncoderLayer(10, 2, 16, batch_first=True), nn.RMSNorm(10), nn.Flatten(),
                         nn.Linear(40, 3))


def test_new_layer_types_keep_state_dict_names_and_seeded_init():
    torch.manual_seed(5)
    model = build(MIXED, limits=Limits())
    torch.manual_seed(5)
    local = _mixed_local()
    assert list(model.state_dict()) == list(local.state_dict())
    for (name, a), b in zip(model.state_dict().items(), local.state_dict().values()):
        assert torch.equal(a, b), name
    out = validate_shapes(build(MIXED, limits=Limits(), device="meta"), torch.empty(3, 2, 6, device="meta"))
    assert list(out.shape) == [3, 3]


def test_a_recurrent_layer_outputs_its_output_sequence():
    torch.manual_seed(0)
    model = build([{"type": "GRU", "input_size": 3, "hidden_size": 4, "num_layers": 2}], limits=Limits())
    torch.manual_seed(0)
    local = nn.GRU(3, 4, num_layers=2)
    x = torch.randn(5, 2, 3)
    torch.testing.assert_close(model(x), local(x)[0], rtol=0, atol=0)


@pytest.mark.parametrize("layers, shape, fragment", [
    ([{"type": "Conv3d", "in_channels": 2, "out_channels": 4, "kernel_size": 3}], (1, 3, 5, 5, 5),
     "layer 0 (Conv3d) expects 2 input channels, got 3 from the inputs; set in_channels=3"),
    ([{"type": "Linear", "in_features": 4, "out_features": 4}, {"type": "LSTM", "input_size": 3, "hidden_size": 2}],
     (2, 5, 4), "layer 1 (LSTM) expects 3 input features, got 4 from layer 0 (Linear); set input_size=4"),
    ([{"type": "TransformerEncoderLayer", "d_model": 8, "nhead": 2}], (2, 5, 6),
     "layer 0 (TransformerEncoderLayer) expects 8 features (d_model) in the last dim, got 6 from the inputs; "
     "set d_model=6"),
    ([{"type": "GroupNorm", "num_groups": 2, "num_channels": 4}], (2, 6, 3),
     "layer 0 (GroupNorm) expects 4 channels in dim 1, got 6 from the inputs; set num_channels=6"),
    ([{"type": "BatchNorm3d", "num_features": 3}], (2, 3, 4, 4), "layer 0 (BatchNorm3d) expects a 5-d input"),
])
def test_shape_prechecks_name_the_layer_and_the_fix(layers, shape, fragment):
    model = build(layers, limits=Limits(), device="meta")
    with pytest.raises(SpecError) as info:
        validate_shapes(model, torch.empty(*shape, device="meta"))
    assert info.value.code == "shape_mismatch"
    assert fragment in info.value.message


def test_a_layer_whose_output_is_too_large_is_refused_before_it_runs():
    model = build([{"type": "Upsample", "scale_factor": 1000.0}], limits=Limits(), device="meta")
    with pytest.raises(SpecError) as info:
        validate_shapes(model, torch.empty(2, 3, 100, 100, device="meta"), max_elements=1_000_000)
    assert info.value.code == "too_large"
    assert "layer 0 (Upsample) outputs shape [2, 3, 100000, 100000]" in info.value.message


def test_nesting_deeper_than_the_limit_is_refused():
    spec = {"type": "ReLU"}
    for _ in range(10):
        spec = {"type": "Sequential", "layers": [spec]}
    with pytest.raises(SpecError) as info:
        build([spec], limits=Limits(max_depth=4), device="meta")
    assert info.value.code == "too_large"


def test_catalogue_lists_every_allowed_layer_with_defaults_and_ranges():
    catalogue = {entry["type"]: entry for entry in layer_catalogue()}
    assert set(LAYERS) | {"Sequential", "Residual"} == set(catalogue)
    names = set(catalogue)
    momentum = catalogue["BatchNorm1d"]["details"]["momentum"]
    assert momentum == {"kind": "number | null", "required": False, "default": 0.1, "range": ""}
    assert catalogue["Dropout"]["details"]["p"]["range"] == "[0, 1]"
    assert catalogue["Linear"]["details"]["in_features"] == {"kind": "int", "required": True, "range": ">= 1"}
    assert catalogue["LSTM"]["output"] == "sequence"
    for required in ("Linear", "Conv1d", "Conv2d", "MaxPool2d", "AvgPool2d", "Flatten", "ReLU", "LeakyReLU", "GELU",
                     "Tanh", "Sigmoid", "Softmax", "Dropout", "BatchNorm1d", "BatchNorm2d", "LayerNorm", "Embedding"):
        assert required in names


def test_a_norm_layer_without_bias_is_built_on_a_torch_whose_constructor_lacks_the_argument():
    """torch 2.11's BatchNorm, InstanceNorm and GroupNorm take no `bias`: the layer is built with its affine
    parameters and the bias removed, as the newer constructor leaves it."""
    from gradsvc.engine.spec import construct

    class OldBatchNorm(nn.BatchNorm1d):  # a constructor as torch 2.11's
        def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
            super().__init__(num_features, eps, momentum, affine, track_running_stats)

    old = construct(OldBatchNorm, {"num_features": 3, "eps": 1e-5, "momentum": 0.1, "affine": True,
                                   "track_running_stats": True, "bias": False})
    assert old.bias is None and list(old.state_dict()) == ["weight", "running_mean", "running_var",
                                                           "num_batches_tracked"]
    kept = construct(OldBatchNorm, {"num_features": 3, "bias": True})
    assert kept.bias is not None
    x = torch.randn(5, 3)
    torch.testing.assert_close(old(x), torch.nn.functional.batch_norm(x, None, None, old.weight, None, training=True))
    assert read_args("BatchNorm1d", old)["bias"] is False


def test_every_argument_of_the_layer_table_is_one_this_torch_takes_or_one_the_engine_builds_without():
    """The layer table is torch-free; on the oldest admitted torch (make test-compat) a constructor may lack an
    argument the table lists. The only one allowed is a norm layer's `bias` (spec.construct removes the bias)."""
    from gradsvc.modules import layer_class

    emulated = {"bias"}
    lacking = []
    for kind, layer in LAYERS.items():
        params = inspect.signature(layer_class(kind).__init__).parameters
        if any(p.kind == p.VAR_KEYWORD for p in params.values()):
            continue
        lacking += [(kind, name) for name in layer.args if name not in params and name not in emulated]
    assert not lacking, f"arguments this torch ({torch.__version__}) does not take: {lacking}"


@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
def test_a_recurrent_layer_without_bias_is_built_as_torch_builds_it(kind):
    """A recurrent layer's constructor takes `bias` through **kwargs, and its `bias` attribute is a flag: the norm
    layers' fallback for a constructor without the argument must not apply to it."""
    model = build([{"type": kind, "input_size": 3, "hidden_size": 4, "bias": False}], limits=Limits())
    torch.manual_seed(0)
    local = getattr(nn, kind)(3, 4, bias=False)
    assert model[0].bias is False
    assert sorted(model.state_dict()) == sorted(f"0.{k}" for k in local.state_dict())
