"""Real training code through the SDK, the API, Redis and a real worker: several inputs (by position and
by name), every-position LM losses, the model's own loss, custom autograd Functions with their own
backward, and dropout that draws fresh masks per call. Each gradient is compared with local autograd
(float32: within 1e-4 of the tensor's largest gradient)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn
from torch.nn import functional as F

from gradclient.errors import BadOptionError, BadTensorError, UnsupportedModuleError

pytestmark = pytest.mark.timeout(600)
TOL = 1e-4


def local(model: nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss_fn().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(result, want: dict[str, torch.Tensor], tol: float = TOL) -> None:
    got = {n: g for n, g in result.gradients.items() if g is not None}
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for name, g in want.items():
        scale = max(float(g.abs().max()), 1e-30)
        err = float((torch.as_tensor(got[name]).to(g.dtype) - g).abs().max())
        assert err <= tol * scale, f"{name}: max error {err:.3g} against scale {scale:.3g}"


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(vocab_size=61, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


class EveryPositionLM(nn.Module):
    """A causal LM's logits over every position, flattened: (batch*seq, vocab), the standard LM loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_gpt2()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits.flatten(0, 1)  # (batch*seq, vocab)


def test_causal_lm_loss_over_every_position_and_its_micro_batches(client):
    torch.manual_seed(0)
    model = EveryPositionLM()
    ids = torch.randint(0, 61, (3, 9))
    y = torch.randint(0, 61, (27,))  # the next tokens, flattened like the logits
    want = local(model, lambda: F.cross_entropy(model(ids), y))
    assert_close(client.gradients(model, ids, y, numcheck="off"), want)
    split = client.gradients(model, ids, y, numcheck="off", micro_batch=1)
    assert split.micro_batches == 3
    assert_close(split, want)


def test_bert_with_attention_mask_by_name_and_hf_labels_as_the_models_own_loss(client):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(cfg)
    ids = torch.randint(0, 50, (4, 7))
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    labels = torch.tensor([0, 2, 1, 1])
    batch = {"input_ids": ids, "attention_mask": mask}
    want = local(model, lambda: F.cross_entropy(model(**batch).logits, labels))
    assert_close(client.gradients(model, batch, labels, numcheck="off"), want)
    # The mask matters: the same ids unmasked give other gradients.
    unmasked = local(model, lambda: F.cross_entropy(model(input_ids=ids).logits, labels))
    assert float((unmasked["bert.embeddings.word_embeddings.weight"] -
                  want["bert.embeddings.word_embeddings.weight"]).abs().max()) > 1e-6
    own = {**batch, "labels": labels}
    result = client.gradients(model, own, loss="output", numcheck="off")
    assert result.loss == pytest.approx(float(model(**own).loss), rel=1e-5)
    assert_close(result, local(model, lambda: model(**own).loss))
    with pytest.raises(BadOptionError, match="output"):
        client.gradients(model, own, loss="output", numcheck="off", micro_batch=2)


def test_nn_transformer_takes_src_and_tgt_in_order(client):
    torch.manual_seed(0)
    model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
                           dropout=0.0, batch_first=True)
    src, tgt, y = torch.randn(2, 5, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    want = local(model, lambda: F.mse_loss(model(src, tgt), y))
    assert_close(client.gradients(model, (src, tgt), y, loss="mse", numcheck="off"), want)


class MessagePassing(nn.Module):
    """Node features (nodes, features) and an edge list (2, edges) with no batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))  # (nodes, 8)
        messages = torch.zeros_like(h).index_add(0, edge_index[1], h[edge_index[0]])
        return self.out(h + messages)  # (nodes, 3)


def test_message_passing_net_over_nodes_and_an_unbatched_edge_index(client):
    torch.manual_seed(0)
    model = MessagePassing()
    x = torch.randn(6, 4)
    edges = torch.tensor([[0, 1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 0, 3]])
    y = torch.randint(0, 3, (6,))
    want = local(model, lambda: F.cross_entropy(model(x, edges), y))
    assert_close(client.gradients(model, [x, edges], y, numcheck="off"), want)
    # Nodes exchange messages: splitting the nodes would change every gradient, so it is refused.
    with pytest.raises(BadOptionError, match="micro_batch"):
        client.gradients(model, [x, edges], y, numcheck="off", micro_batch=3)


class Contrastive(nn.Module):
    """Two views of a batch and an InfoNCE loss written in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        za = F.normalize(self.encoder(a), dim=-1)
        zb = F.normalize(self.encoder(b), dim=-1)
        logits = za @ zb.T / 0.1  # (batch, batch)
        return F.cross_entropy(logits, torch.arange(a.shape[0]))


def test_a_forward_that_computes_its_own_contrastive_loss(client):
    torch.manual_seed(0)
    model = Contrastive()
    a = torch.randn(5, 6)
    b = a + 0.1 * torch.randn(5, 6)
    result = client.gradients(model, (a, b), loss="output", numcheck="off")
    assert result.loss == pytest.approx(float(model(a, b)), rel=1e-5)
    assert_close(result, local(model, lambda: model(a, b)))


def test_an_encoder_decoder_with_labels(client):
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                use_cache=False)  # training: no key/value cache in the output
    model = transformers.T5ForConditionalGeneration(cfg)
    ids = torch.randint(1, 40, (2, 6))
    labels = torch.randint(1, 40, (2, 5))
    batch = {"input_ids": ids, "labels": labels}
    result = client.gradients(model, batch, loss="output", numcheck="off")  # T5's attention: aten.min.other
    assert_close(result, local(model, lambda: model(**batch).loss))


class GRULanguageModel(nn.Module):
    def __init__(self, rnn: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.rnn = rnn(8, 12, batch_first=True)
        self.head = nn.Linear(12, 30)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(ids))  # (batch, seq, 12)
        return self.head(h).flatten(0, 1)  # (batch*seq, 30)


@pytest.mark.parametrize("rnn", [nn.GRU, nn.LSTM], ids=["gru", "lstm"])
def test_a_recurrent_language_model_inside_a_custom_module(client, rnn):
    torch.manual_seed(0)
    model = GRULanguageModel(rnn)
    ids = torch.randint(0, 30, (3, 7))
    y = torch.randint(0, 30, (21,))
    result = client.gradients(model, ids, y, numcheck="off")  # aten.gru.input / aten.lstm.input
    assert_close(result, local(model, lambda: F.cross_entropy(model(ids), y)))


class RoundStraightThrough(torch.autograd.Function):
    """A straight-through estimator: round forward, identity backward inside [-1, 1]."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1).to(g.dtype)


class Scaled(torch.autograd.Function):
    """x * w * k with its (right) backward written by hand, a number among its arguments."""

    @staticmethod
    def forward(ctx, x, w, k):
        ctx.save_for_backward(x, w)
        ctx.k = k
        return x * w * k

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w * ctx.k, (g * x * ctx.k).sum(0), None


class Quantised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.randn(3))
        self.last = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(Scaled.apply(RoundStraightThrough.apply(self.first(x)), self.scale, 2.0))


def test_custom_functions_keep_their_backward_and_the_check_judges_it(client):
    torch.manual_seed(0)
    model = Quantised()
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    want = local(model, lambda: F.cross_entropy(model(x), y))
    assert float(want["first.weight"].abs().max()) > 0  # the straight-through gradient, not round's zero
    assert_close(client.gradients(model, x, y, numcheck="off"), want)
    model64 = copy.deepcopy(model).double()
    result = client.gradients(model64, x.double(), y, numcheck="exact")
    per = result.numcheck.per_parameter
    # The straight-through backward is not round's derivative: the check says so for the layer before it...
    assert not result.numcheck.passed and per["first.weight"].max_rel_error > 0.5
    # ... and passes the hand-written backward of Scaled and everything after it.
    assert per["scale"].max_rel_error < 1e-6 and per["last.weight"].max_rel_error < 1e-6


class NotCapturable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return torch.from_numpy(g.detach().numpy() * 2)  # leaves torch: no graph can hold it


def test_a_function_whose_backward_cannot_be_captured_is_refused_before_sending(client):
    model = nn.Sequential(nn.Linear(3, 2))

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x):
            return NotCapturable.apply(self.inner(x))

    with pytest.raises(UnsupportedModuleError, match="NotCapturable"):
        client.gradients(Wrap(), torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))


class NoGradBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            scale = h.abs().mean(dim=1, keepdim=True) + 1.0
        return self.b(h / scale + h.detach())


def test_a_forward_with_a_no_grad_block_and_detach(client):
    torch.manual_seed(0)
    model = NoGradBlock()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    result = client.gradients(model, x, y, numcheck="off")
    assert_close(result, local(model, lambda: F.cross_entropy(model(x), y)))


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


def test_dropout_draws_fresh_masks_per_call_and_a_seed_repeats_one(client):
    torch.manual_seed(0)
    model = Dropped().train()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    first = client.gradients(model, x, y, numcheck="off")
    second = client.gradients(model, x, y, numcheck="off")
    assert first.seed != second.seed
    assert not torch.equal(torch.as_tensor(first.gradients["a.weight"]), torch.as_tensor(second.gradients["a.weight"]))
    again = client.gradients(model, x, y, numcheck="off", seed=first.seed)
    assert again.seed == first.seed
    assert torch.equal(torch.as_tensor(again.gradients["a.weight"]), torch.as_tensor(first.gradients["a.weight"]))
    torch.manual_seed(7)
    run1 = client.gradients(model, x, y, numcheck="off").seed
    torch.manual_seed(7)
    assert client.gradients(model, x, y, numcheck="off").seed == run1  # torch.manual_seed makes a run repeat
    # The masks stay fixed across the numerical check's evaluations: a right gradient passes.
    checked = client.gradients(copy.deepcopy(model).double(), x.double(), y, numcheck="exact")
    assert checked.numcheck.passed, checked.numcheck


def test_inputs_the_sdk_cannot_send_get_a_typed_error_naming_the_argument(client):
    model = Contrastive()
    with pytest.raises(BadTensorError, match=r"inputs\['b'\]"):
        client.gradients(model, {"a": torch.randn(2, 6), "b": "not a tensor"}, loss="output")
    with pytest.raises(UnsupportedModuleError, match="'b'"):
        client.gradients(model, {"a": torch.randn(2, 6)}, loss="output")  # b missing: named before sending


def test_named_inputs_and_every_position_targets_split_across_shards_and_per_sample(client):
    torch.manual_seed(0)
    model = EveryPositionLM()
    ids = torch.randint(0, 61, (4, 6))
    y = torch.randint(0, 61, (24,))
    want = local(model, lambda: F.cross_entropy(model(ids), y))
    sharded = client.gradients(model, {"ids": ids}, y, numcheck="off", shards=2)
    assert sharded.shards is not None and sharded.shards.count == 2
    assert_close(sharded, want)
    per = client.gradients(model, ids, y, numcheck="off", per_sample="full")
    total = {n: torch.as_tensor(g).mean(0) for n, g in per.per_sample.gradients.items()}
    for name, g in want.items():  # the per-example gradients average to the batch's (mean loss)
        assert float((total[name] - g).abs().max()) <= TOL * max(float(g.abs().max()), 1e-30), name
