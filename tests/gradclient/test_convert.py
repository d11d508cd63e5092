"""nn.Module -> spec: what converts (and to the service's names), and what is refused, naming the layer."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from gradclient import LSTM, Residual, UnsupportedModuleError
from gradclient.convert import convert, from_spec, to_spec
from gradsvc.layers import LAYERS, canonical

from tests.support.layer_samples import every_argument_value


def test_sequential_converts_to_layers_with_their_arguments_and_state_dict_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 10))
    spec = to_spec(model)
    assert spec["layers"] == [
        {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": [3, 3], "stride": [1, 1],
         "padding": [1, 1], "dilation": [1, 1], "groups": 1, "padding_mode": "zeros", "bias": False},
        {"type": "MaxPool2d", "kernel_size": 2, "stride": 2, "padding": 0, "dilation": 1, "return_indices": False,
         "ceil_mode": False},
        {"type": "Flatten", "start_dim": 1, "end_dim": -1},
        {"type": "Linear", "in_features": 64, "out_features": 10, "bias": True},
    ]
    assert spec["dtype"] == "float32"
    assert set(spec["weights"]) == set(model.state_dict())
    assert spec["weights"]["3.weight"] is not None and torch.equal(spec["weights"]["3.weight"], model[3].weight)


def test_residual_and_nested_sequential_keep_nn_sequential_names():
    model = nn.Sequential(nn.Linear(4, 4), Residual(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 2)))
    c = convert(model)
    assert [layer["type"] for layer in c.layers] == ["Linear", "Residual", "Sequential"]
    assert c.layers[1]["layers"][1] == {"type": "Tanh"}
    assert set(c.weights) == set(model.state_dict()) == {"0.weight", "0.bias", "1.0.weight", "1.0.bias",
                                                         "2.0.weight", "2.0.bias"}


def test_named_children_and_a_bare_layer_map_to_service_names_and_back():
    named = nn.Sequential(OrderedDict(fc1=nn.Linear(3, 5), act=nn.ReLU(), fc2=nn.Linear(5, 2)))
    named.fc1.weight.requires_grad_(False)
    c = convert(named)
    assert c.local_names == {"0.weight": "fc1.weight", "0.bias": "fc1.bias", "2.weight": "fc2.weight",
                             "2.bias": "fc2.bias"}
    assert c.frozen == ["0.weight"]
    bare = convert(nn.Linear(3, 2))
    assert bare.layers == [{"type": "Linear", "in_features": 3, "out_features": 2, "bias": True}]
    assert bare.local_names == {"0.weight": "weight", "0.bias": "bias"}


def test_batchnorm_buffers_travel_with_the_weights():
    c = convert(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double())
    assert c.dtype == "float64"
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(c.weights)


class CustomForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2


class LinearWithTwist(nn.Linear):
    def forward(self, x):
        return super().forward(x).relu()


@pytest.mark.parametrize("model, where", [
    (nn.Sequential(nn.Linear(4, 4), CustomForward()), "layer 1 (CustomForward)"),
    (nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), LinearWithTwist(4, 4))), "layer 1.1 (LinearWithTwist)"),
    (nn.Sequential(nn.Linear(4, 4), nn.LSTMCell(4, 4)), "layer 1 (LSTMCell)"),
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2, return_indices=True)), "layer 1 (MaxPool2d): return_indices"),
    (nn.Sequential(nn.Embedding(10, 4, sparse=True)), "layer 0 (Embedding): sparse=True is not supported"),
    (nn.Sequential(nn.LSTM(4, 4)), "layer 0 (LSTM): the service's LSTM outputs the output sequence alone"),
    (nn.Sequential(nn.TransformerEncoderLayer(4, 2, activation=torch.tanh)), "layer 0 (TransformerEncoderLayer): "
     "activation"),
    (nn.ModuleList([nn.Linear(2, 2)]), "layer 0 (ModuleList)"),
])
def test_refuses_a_module_it_cannot_express_naming_the_layer(model, where):
    with pytest.raises(UnsupportedModuleError) as info:
        convert(model)
    assert where in str(info.value)
    assert info.value.code == "unsupported_module"


def test_refuses_hooks_and_mixed_dtypes():
    hooked = nn.Sequential(nn.Linear(2, 2))
    hooked[0].register_forward_hook(lambda m, i, o: o * 0)
    with pytest.raises(UnsupportedModuleError, match="layer 0 .Linear. has hooks"):
        convert(hooked)
    with pytest.raises(UnsupportedModuleError, match="mixes parameter dtypes"):
        convert(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))


def test_spec_to_module_to_spec_is_the_identity_for_every_layer_and_argument_value():
    covered: set[tuple[str, str | None]] = set()
    for kind, name, spec in every_argument_value():
        args = {k: v for k, v in spec.items() if k != "type"}
        try:
            module = from_spec([spec])
        except (ValueError, RuntimeError, AssertionError) as exc:  # torch refuses the combination
            raise AssertionError(f"the table accepts {spec} but torch refuses it: {exc}") from None
        back = to_spec(module)["layers"]
        want = [{"type": kind, **canonical(kind, args)}]
        assert back == want, spec
        assert to_spec(from_spec(back))["layers"] == back, spec
        covered.add((kind, name))
    missing = [(k, n) for k, layer in LAYERS.items() for n in layer.args if (k, n) not in covered]
    assert not missing, f"no accepted value tried for {missing}"


def test_the_sdk_module_for_a_recurrent_layer_returns_the_output_sequence_and_converts():
    torch.manual_seed(0)
    lstm = LSTM(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    torch.testing.assert_close(lstm(x), nn.LSTM.forward(lstm, x)[0])
    c = convert(nn.Sequential(lstm, nn.Flatten(), nn.Linear(20, 2)))
    assert c.layers[0] == {"type": "LSTM", "input_size": 3, "hidden_size": 4, "num_layers": 1, "bias": True,
                           "batch_first": True, "dropout": 0.0, "bidirectional": False, "proj_size": 0}
    assert "0.weight_ih_l0" in c.weights
