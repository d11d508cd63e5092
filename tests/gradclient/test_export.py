"""The SDK's exporter: nn.Module -> GraphSpec + weights, what it captures and what it refuses."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from gradclient.convert import UnsupportedModuleError
from gradclient.export import export_graph
from gradsvc import wire
from gradsvc.engine.graph.compiler import build_graph
from gradsvc.engine.graph.interpreter import load_weights
from gradsvc.engine.spec import Limits

from tests.support import models


def run_graph(eg, x: torch.Tensor) -> torch.Tensor:
    model = build_graph(eg.graph, limits=Limits(), device="meta")
    return load_weights(model, dict(eg.weights), device="cpu")(x)


def test_one_dynamic_export_serves_batch_3_and_7():
    model, _ = models.build("resnet_block")
    model.eval()
    eg = export_graph(model, (torch.randn(4, 4, 6, 6),))
    assert eg.dynamic_batch
    for batch in (3, 7):
        x = torch.randn(batch, 4, 6, 6)
        assert torch.allclose(run_graph(eg, x), model(x), atol=1e-6)


def test_a_batch_of_one_still_exports_a_dynamic_batch():
    model, x = models.build("prenorm_block")
    eg = export_graph(model, (x[:1],))
    assert eg.dynamic_batch
    for batch in (1, 5):
        xb = torch.randn(batch, 5, 8)
        assert torch.allclose(run_graph(eg, xb), model(xb), atol=1e-6)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a value: torch.export cannot capture it
            return self.fc(x)
        return -self.fc(x)


def test_control_flow_on_values_is_captured_as_this_call_ran_it(capfd):
    torch.manual_seed(0)
    model, x = DataDependent(), torch.randn(3, 4).abs()  # x.sum() > 0: the first branch
    eg = export_graph(model, (x,))
    assert eg.capture == "trace" and not eg.dynamic_batch
    assert torch.allclose(run_graph(eg, x), model(x), atol=1e-6)
    assert capfd.readouterr().err == ""  # neither torch's logs nor the failed traces' graphs


class LeavesTorch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.from_numpy(x.detach().numpy() * 2))  # through numpy: no capture can follow it


def test_a_forward_export_cannot_follow_is_recorded_as_it_ran_and_recorded_again_for_each_batch():
    from gradclient.replay import check_guards

    model, x = LeavesTorch(), torch.randn(3, 4)
    eg = export_graph(model, (x,))
    assert eg.capture == "trace" and "numpy" in eg.why_not_export.lower()
    assert torch.allclose(run_graph(eg, x), model(x))
    assert eg.traced.guards.constants  # the batch went through numpy: a constant, never reused for another batch
    assert not check_guards(eg.traced, model, [x])


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the model's own error")


def test_a_forward_that_fails_locally_is_refused_with_its_own_error():
    with pytest.raises(UnsupportedModuleError, match="the model's own error"):
        export_graph(Fails(), (torch.randn(3, 4),))


def test_graph_is_plain_data_with_state_dict_targets_and_module_paths():
    model, x = models.build("resnet_block")
    eg = export_graph(model, (x,))
    raw = msgspec.json.encode(eg.graph)
    assert msgspec.json.decode(raw, type=wire.GraphSpec) == eg.graph
    params = {i.target for i in eg.graph.inputs if i.kind == "parameter"}
    buffers = {i.target for i in eg.graph.inputs if i.kind == "buffer"}
    assert params == {n for n, _ in model.named_parameters()}
    assert buffers == {n for n, _ in model.named_buffers()}
    assert set(eg.weights) == params | buffers
    assert eg.graph.dtype == "float32"
    ops = {n.op for n in eg.graph.nodes}
    assert {"aten.conv2d.default", "aten.batch_norm.default", "aten.add_.Tensor", "aten.relu.default"} <= ops
    by_op = {n.op: n for n in eg.graph.nodes}
    assert (by_op["aten.conv2d.default"].module, by_op["aten.conv2d.default"].module_type) in \
        {("conv1", "Conv2d"), ("conv2", "Conv2d")}
    # Training-mode batch norm: in the default export IR the running statistics are updated in place.
    bn = next(n for n in eg.graph.nodes if n.op == "aten.batch_norm.default")
    assert bn.args[5] is True
    x_input = next(i for i in eg.graph.inputs if i.kind == "input")
    assert x_input.dtype == "float32" and x_input.shape == [-1, 4, 6, 6]  # -1: the dynamic batch


def test_frozen_parameters_are_listed():
    model, x = models.build("prenorm_block")
    model.ln1.requires_grad_(False)
    assert export_graph(model, (x,)).frozen == ["ln1.weight", "ln1.bias"]
    assert export_graph(models.build("prenorm_block")[0], (x,)).frozen == []


def test_tied_weights_are_one_parameter():
    model, x = models.build("hf_gpt2_every_position")
    eg = export_graph(model, (x,))
    targets = [i.target for i in eg.graph.inputs if i.kind == "parameter"]
    assert "lm.transformer.wte.weight" in targets and "lm.lm_head.weight" not in targets
    assert set(targets) == {n for n, _ in model.named_parameters()}


def test_lifted_tensor_constants_travel_as_wire_tensors():
    class WithConstant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * torch.tensor([1.0, 2.0, 3.0])

    model = WithConstant()
    x = torch.randn(2, 3)
    eg = export_graph(model, (x,))
    assert len(eg.graph.constants) == 1
    (const,) = eg.graph.constants.values()
    assert const.dtype == "float32" and const.shape == [3]
    assert torch.allclose(run_graph(eg, x), model(x))
    for codec in (msgspec.json, msgspec.msgpack):  # raw bytes: base64 in JSON, bin in MessagePack
        eg.graph = codec.decode(codec.encode(eg.graph), type=wire.GraphSpec)
        assert torch.allclose(run_graph(eg, x), model(x))


def test_a_forward_writing_its_input_computes_on_the_services_copy():
    class MutatesInput(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.add_(1)
            return x * 2

    x = torch.randn(2, 3)
    eg = export_graph(MutatesInput(), (x,))
    kept = x.clone()
    assert torch.equal(run_graph(eg, x), (kept + 1) * 2)
    assert torch.equal(x, kept)  # the caller's batch as it was


def test_what_export_gives_for_attention_transformer_encoder_dropout_and_train_mode_batch_norm():
    """The ops the interpreter must cover, as the default export IR of torch 2.13 gives them."""
    model, x = models.build("prenorm_block")
    ops = {n.op for n in export_graph(model, (x,)).graph.nodes}
    assert {"aten.scaled_dot_product_attention.default", "aten.linear.default", "aten.layer_norm.default",
            "aten.sym_size.int", "operator.mul", "aten.expand.default", "aten.cat.default"} <= ops
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                enable_nested_tensor=False)
    for mode in ("train", "eval"):
        getattr(enc, mode)()
        ops = {n.op for n in export_graph(enc, (torch.randn(3, 5, 8),)).graph.nodes}
        # No fused fast path (_transformer_encoder_layer_fwd) in either mode: export traces the slow path.
        assert not any("transformer_encoder_layer" in op for op in ops), ops
        assert "aten.dropout.default" in ops


def test_module_paths_are_state_dict_prefixes():
    from gradclient.export import _state_dict_path

    assert _state_dict_path("layer1.0.conv1") == "layer1.0.conv1"
    assert _state_dict_path("L['self'].layer1[0].conv1") == "layer1.0.conv1"  # older torch's spelling
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 2)))
    eg = export_graph(model, (torch.randn(2, 3),))
    assert [(n.module, n.module_type) for n in eg.graph.nodes] == \
        [("0", "Linear"), ("1.0", "ReLU"), ("1.1", "Linear")]


class NoGradStatistics(nn.Module):
    def __init__(self, write_weight: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3))
        self.write_weight = write_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        with torch.no_grad():
            self.seen.add_(h.mean(0))  # a buffer, updated in place
            scale = h.abs().amax(-1, keepdim=True)
            if self.write_weight:
                self.fc.weight.mul_(0.5)
        return h / scale


def test_a_no_grad_block_is_inlined_with_its_inputs_detached():
    x = torch.randn(2, 3)
    model = NoGradStatistics()
    eg = export_graph(model, (x,))
    ops = [n.op for n in eg.graph.nodes]
    assert not any("wrap" in op or "higher_order" in op for op in ops)
    detached = {n.args[0]["node"] for n in eg.graph.nodes if n.op == "aten.detach.default"}
    assert detached == {"linear"}  # the buffer is written as itself, not through a detached view
    want = model(x)
    assert torch.allclose(run_graph(eg, x), want)
    with pytest.raises(UnsupportedModuleError, match="modifies its parameter 'p_fc_weight' in place"):
        export_graph(NoGradStatistics(write_weight=True), (x,))


class WritesThroughData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("ema", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        self.ema.data = 0.9 * self.ema.data + 0.1 * out.detach().mean(0)
        return out


def test_a_buffer_written_through_data_is_refused_with_the_in_place_form_as_the_way_out():
    model = WritesThroughData()
    with pytest.raises(UnsupportedModuleError, match=r"torch\.no_grad\(\)"):
        export_graph(model, (torch.randn(3, 4),))
    assert torch.equal(model.ema, torch.zeros(2))  # the module as it was


class NestedOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        out = self.fc(x)
        return {"logits": out, "state": (state[0] + 1, state[1] * 2), "loss": out.mean()}


def test_nested_inputs_flatten_in_order_and_the_output_tree_keeps_forwards_structure():
    x, state = torch.randn(3, 4), (torch.randn(3, 2), torch.randn(3, 5))
    eg = export_graph(NestedOutputs(), (x, state))
    assert [i.name for i in eg.graph.inputs if i.kind == "input"] == ["x", "state_0", "state_1"]
    assert eg.graph.output_tree == {"logits": 0, "state": [1, 2], "loss": 3}


class Recorded(nn.Module):
    """What export cannot capture: a validating distribution, an `if` on a value, state assigned in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 3), nn.BatchNorm1d(3)
        self.register_buffer("seen", torch.zeros(3))
        self.last = torch.zeros(1)  # a plain attribute whose shape follows the batch: not carried

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(x)
        h = self.bn(z)
        self.seen = h.detach().mean(0)
        self.last = h.detach()
        if (z - self.fc.bias).sum() > 0:  # linear in x: -x takes the other branch
            h = 2 * h
        return -torch.distributions.Normal(h, torch.ones_like(h), validate_args=True).log_prob(
            torch.zeros_like(h)).mean()


def test_a_recording_leaves_the_module_as_it_was_lists_its_guards_and_says_when_they_hold():
    from gradclient.replay import check_guards

    torch.manual_seed(0)
    model, x = Recorded(), torch.randn(5, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eg = export_graph(model, (x,))
    assert eg.capture == "trace"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # running stats untouched
    assert set(eg.graph.buffer_mutations) == {"seen", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    guards = eg.traced.guards.as_dict()
    assert guards["inputs"] == [{"shape": [5, 4], "dtype": "float32"}] and len(guards["values"]) >= 2
    assert torch.allclose(run_graph(eg, x), Recorded.forward(copy_of(model), x))
    assert check_guards(eg.traced, model, [x]) and not check_guards(eg.traced, model, [torch.randn(6, 4)])
    assert not check_guards(eg.traced, model, [-x])  # the other branch


def copy_of(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


class OtherPathWhenTraced(nn.Module):
    """A forward that computes something else while torch traces it (as a library checking
    `torch.compiler.is_compiling()` may): the exported program is not what the module runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * 2 if torch.compiler.is_compiling() else torch.tanh(h)


def test_an_export_that_computes_other_values_than_the_module_is_recorded_instead():
    x = torch.randn(4, 3)
    model = OtherPathWhenTraced()
    eg = export_graph(model, (x,))
    assert eg.capture == "trace" and "differs from the module's" in eg.why_not_export, eg.why_not_export
    assert torch.allclose(run_graph(eg, x), model(x))
    plain = export_graph(nn.Sequential(nn.Linear(3, 2), nn.Tanh()), (x,))
    assert plain.capture == "export" and plain.why_not_export is None
