"""A session's forward alone (TrainingSession.forward): the loss, outputs and per-target log-probabilities equal
the local module's forward in float64, and nothing of the session changes (weights, buffers, optimizer, step):
the steps after it equal local training that never ran it."""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch
import torch.nn.functional as F

from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc import wire
from gradsvc.engine.errors import SpecError

from .test_session import LAYERS, TinyLM, assert_same_state, batch, batches, local_bn_net, local_steps, session_for


def _bare(x: torch.Tensor, **fields) -> wire.SessionBatch:
    return msgspec.convert({"inputs": to_wire(x), **fields}, wire.SessionBatch)


def test_a_forward_answers_the_local_forward_and_changes_nothing_of_a_batchnorm_session():
    local = local_bn_net(torch.float64)
    spec = {"layers": LAYERS, "dtype": "float64", "weights": {k: to_wire(v) for k, v in local.state_dict().items()}}
    session = session_for(spec, "adamw", dict(lr=1e-2, weight_decay=0.1))
    data = batches(4, torch.float64)
    session.train_step(batch(*data[0]))
    before = {n: t.clone() for n, t in session.model.state_dict().items()}
    x, y = data[3]
    reference = copy.deepcopy(local)
    local_steps(reference, "adamw", dict(lr=1e-2, weight_decay=0.1), data[:1], None)
    expected = reference(x)  # train mode: batch statistics, as the session's step runs it
    done = session.forward(batch(x, y))
    torch.testing.assert_close(done.outputs[0], expected.detach(), rtol=1e-12, atol=1e-12)
    assert done.loss == pytest.approx(float(F.cross_entropy(expected, y).detach()), rel=1e-12)
    torch.testing.assert_close(done.extra["logprobs"]["loss"], -F.cross_entropy(expected, y, reduction="none").detach(),
                               rtol=1e-12, atol=1e-12)
    assert (session.step, session.accumulated) == (1, 0)
    for name, value in session.model.state_dict().items():
        assert torch.equal(value, before[name]), name  # the running statistics too
    for xb, yb in data[1:3]:
        session.train_step(batch(xb, yb))
    opt = local_steps(local, "adamw", dict(lr=1e-2, weight_decay=0.1), data[:3], None)
    assert_same_state(session, local, opt, torch.float64)


def test_a_graph_sessions_forward_gives_every_output_without_targets_and_its_loss_with_them():
    torch.manual_seed(0)
    local = TinyLM().double()
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 11, (4, 5), generator=g) for _ in range(2)]
    labels = torch.randint(0, 3, (4,), generator=g)
    eg = export_graph(copy.deepcopy(local), (tokens[0],))
    spec = {"graph": msgspec.to_builtins(eg.graph), "dtype": "float64",
            "weights": {k: to_wire(v.double()) for k, v in eg.weights.items()}}
    session = session_for(spec, "sgd", dict(lr=0.1))
    bare = session.forward(_bare(tokens[1]))
    assert bare.loss is None and bare.extra["logprobs"] == {}
    torch.testing.assert_close(bare.outputs[0], local(tokens[1]).detach(), rtol=1e-12, atol=1e-12)
    nll = session.forward(batch(tokens[1], labels, loss="nll"))  # nll over logits: any class-index loss
    expected = local(tokens[1]).detach()
    assert nll.loss == pytest.approx(float(F.nll_loss(expected, labels)), rel=1e-12)
    torch.testing.assert_close(nll.extra["logprobs"]["loss"], expected.gather(1, labels[:, None])[:, 0],
                               rtol=1e-12, atol=1e-12)
    mse = session.forward(batch(tokens[1], torch.zeros(4, 3, dtype=torch.float64), loss="mse"))
    assert mse.extra["logprobs"] == {} and mse.loss == pytest.approx(float(expected.pow(2).mean()), rel=1e-12)
    assert session.step == 0 and all(p.grad is None for p in session.params.values())


@pytest.mark.parametrize("fields, named", [
    ({"lr": 0.1}, "lr"),
    ({"return": ["gradients"]}, "return"),
    ({"return": ["weights"]}, "return"),
    ({"options": {"numcheck": "exact"}}, "options.numcheck"),
    ({"options": {"diagnostics": ["norms"]}}, "options.diagnostics"),
    ({"options": {"clip": {"max_norm": 1.0}}}, "options.clip"),
])
def test_a_forward_refuses_what_only_a_step_does_naming_it(fields, named):
    local = local_bn_net(torch.float64)
    spec = {"layers": LAYERS, "dtype": "float64", "weights": {k: to_wire(v) for k, v in local.state_dict().items()}}
    session = session_for(spec, "sgd", dict(lr=0.1))
    x, y = batches(1, torch.float64)[0]
    with pytest.raises(SpecError) as err:
        session.forward(batch(x, y, **fields))
    assert err.value.code == "bad_option" and err.value.detail["option"] == named


class OwnLossLM(torch.nn.Module):
    """A language model as Hugging Face's return one: (its own loss, logits [batch, positions, vocab])."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(13, 6)
        self.head = torch.nn.Linear(6, 13)

    def forward(self, tokens, labels):
        logits = self.head(torch.tanh(self.emb(tokens)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def test_with_the_models_own_loss_targets_give_each_positions_log_probability_over_the_last_dim():
    torch.manual_seed(0)
    local = OwnLossLM().double()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 13, (3, 7), generator=g)
    eg = export_graph(copy.deepcopy(local), (tokens, tokens))
    spec = {"graph": msgspec.to_builtins(eg.graph), "dtype": "float64",
            "weights": {k: to_wire(v.double()) for k, v in eg.weights.items()}}
    session = session_for(spec, "adamw", dict(lr=1e-2))
    session.train_step(msgspec.convert({"inputs": [to_wire(tokens), to_wire(tokens)], "loss": "output"},
                                       wire.SessionBatch))
    shifted = torch.roll(tokens, -1, dims=1)
    shifted[:, -1] = -100  # the last position predicts nothing
    done = session.forward(msgspec.convert({"inputs": [to_wire(tokens), to_wire(tokens)], "loss": "output",
                                            "targets": to_wire(shifted)}, wire.SessionBatch))
    reference = copy.deepcopy(local)
    reference.load_state_dict(session.model.state_dict())  # the weights after the session's step
    loss, logits = (t.detach() for t in reference(tokens, tokens))
    assert done.loss == pytest.approx(float(loss), rel=1e-12) and session.step == 1
    expected = torch.log_softmax(logits, -1).gather(-1, shifted.clamp(min=0)[..., None])[..., 0]
    expected[:, -1] = 0.0
    torch.testing.assert_close(done.extra["logprobs"]["loss"], expected, rtol=1e-12, atol=1e-12)
    for bad, says in [(torch.zeros(3, 6, dtype=torch.int64), "no output of the model is shaped [3, 6]"),
                      (torch.full((3, 7), 13), "must lie in [0, 12]"), (torch.zeros(3, 7), "send integers")]:
        with pytest.raises(SpecError, match=says.replace("[", r"\[").replace("]", r"\]")) as err:
            session.forward(msgspec.convert({"inputs": [to_wire(tokens), to_wire(tokens)], "loss": "output",
                                             "targets": to_wire(bad)}, wire.SessionBatch))
        assert err.value.code == "bad_target"
