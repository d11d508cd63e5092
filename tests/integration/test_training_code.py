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

from gradclient.errors import BadLossError, BadOptionError, BadTensorError, UnsupportedModuleError

from tests.support.functions import RoundStraightThrough, Scaled
from tests.support.public_models import GCN, normalised_adjacency

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


# --- the loss where the model puts it, inputs as loops pass them, what a step changes --------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_dim)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MiniGPT(nn.Module):
    """forward(idx, targets) -> (logits, loss), as nanoGPT and minGPT write it."""

    def __init__(self, vocab: int = 29, dim: int = 16, block: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.ln = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, 2)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.attn(self.ln(x))
        logits = self.head(x)  # (batch, seq, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def test_a_gpt_whose_forward_returns_logits_and_loss(client):
    torch.manual_seed(0)
    model = MiniGPT()
    idx, targets = torch.randint(0, 29, (3, 8)), torch.randint(0, 29, (3, 8))
    result = client.gradients(model, (idx, targets), loss="output", numcheck="off", outputs=True)
    logits, loss = model(idx, targets)
    assert result.loss == pytest.approx(float(loss), rel=1e-5)
    assert_close(result, local(model, lambda: model(idx, targets)[1]))
    got_logits, got_loss = result.outputs  # the tuple forward returns
    assert torch.allclose(got_logits, logits.detach(), atol=1e-5) and float(got_loss) == pytest.approx(float(loss))
    named = client.gradients(model, (idx, targets), loss={"output": 1}, numcheck="off")
    assert named.loss == result.loss


class TwoLosses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        logits = self.lin(x)
        return logits, F.cross_entropy(logits, y), logits.pow(2).mean()


def test_several_scalar_outputs_answer_bad_loss_listing_them(client):
    torch.manual_seed(0)
    model, x, y = TwoLosses(), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(BadLossError, match=r"\[1\], \[2\]") as err:
        client.gradients(model, (x, y), loss="output", numcheck="off")
    assert err.value.detail["candidates"] == ["[1]", "[2]"]
    result = client.gradients(model, (x, y), loss={"output": 2}, numcheck="off")
    assert_close(result, local(model, lambda: model(x, y)[2]))


class StatefulLM(nn.Module):
    """An LSTM language model that takes and returns its (h, c) state (the official word-level LM's loop)."""

    def __init__(self, vocab: int = 31) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.rnn = nn.LSTM(8, 12, batch_first=True)
        self.head = nn.Linear(12, vocab)

    def forward(self, ids: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        out, hidden = self.rnn(self.embed(ids), hidden)
        return self.head(out).flatten(0, 1), hidden  # (batch*seq, vocab), (h, c)


def test_an_sgd_loop_carrying_an_lstm_state_ends_on_the_local_loops_state(client):
    torch.manual_seed(0)
    remote = StatefulLM()
    here = copy.deepcopy(remote)
    batches = [(torch.randint(0, 31, (4, 6)), torch.randint(0, 31, (24,))) for _ in range(3)]
    zeros = (torch.zeros(1, 4, 12), torch.zeros(1, 4, 12))
    opt_remote = torch.optim.SGD(remote.parameters(), lr=0.5)
    opt_here = torch.optim.SGD(here.parameters(), lr=0.5)
    state_remote = state_here = zeros
    for ids, y in batches:
        opt_here.zero_grad()
        logits, state_here = here(ids, state_here)
        want = {n: g.detach().clone() for n, g in zip(
            [n for n, _ in here.named_parameters()],
            torch.autograd.grad(F.cross_entropy(logits, y), list(here.parameters()), retain_graph=True))}
        F.cross_entropy(logits, y).backward()
        opt_here.step()
        state_here = tuple(s.detach() for s in state_here)
        result = client.gradients(remote, (ids, state_remote), y, numcheck="off", outputs=True)
        assert_close(result, want)
        opt_remote.zero_grad()
        result.set_grads(remote)
        opt_remote.step()
        _, state_remote = result.outputs  # the next state, as forward returned it: no extra local forward
        assert isinstance(state_remote, tuple) and torch.allclose(state_remote[0], state_here[0], atol=1e-5)
    assert_state_dicts_close(remote.state_dict(), here.state_dict())


def assert_state_dicts_close(got: dict, want: dict, tol: float = TOL) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        if not w.is_floating_point():
            assert torch.equal(g, w), name
            continue
        scale = max(float(w.abs().max()), 1e-30)
        assert float((g - w).abs().max()) <= tol * scale, name


class CausalEncoder(nn.Module):
    """nn.TransformerEncoder given a causal mask without is_causal: its mask check is data-dependent."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.head(self.encoder(x, mask=mask)).flatten(0, 1)  # (batch*seq, 5)


def test_a_transformer_encoder_with_a_causal_mask_is_captured_for_this_call(client, capfd):
    torch.manual_seed(0)
    model = CausalEncoder()
    x, y = torch.randn(3, 7, 16), torch.randint(0, 5, (21,))
    result = client.gradients(model, x, y, numcheck="off")
    assert result.capture == "trace"
    assert_close(result, local(model, lambda: F.cross_entropy(model(x), y)))
    assert len(capfd.readouterr().err.splitlines()) < 5  # torch's logs of the failed attempts stay quiet




@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_gcn_with_a_sparse_adjacency(client, layout):
    torch.manual_seed(0)
    model, x, y = GCN(), torch.randn(7, 5), torch.randint(0, 3, (7,))
    dense = normalised_adjacency()
    adj = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    result = client.gradients(model, (x, adj), y, loss="nll", numcheck="off")
    assert_close(result, local(model, lambda: F.nll_loss(model(x, adj), y)))


def test_a_tensor_layout_that_cannot_travel_is_a_typed_error_naming_the_argument(client):
    blocked = torch.eye(6).to_sparse_bsr((2, 2))
    with pytest.raises(BadTensorError, match=r"inputs\[1\].*sparse_bsr"):
        client.gradients(GCN(), [torch.randn(6, 5), blocked], torch.randint(0, 3, (6,)), loss="nll")


class Generator(nn.Module):
    def __init__(self, nz: int = 8, ngf: int = 4) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, 1, 4, 2, 1, bias=False), nn.Tanh())  # (batch, 1, 8, 8)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf: int = 4) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 2, 1, 0, bias=False))  # (batch, 1, 1, 1) logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).flatten()


class DiscriminatorLoss(nn.Module):
    """The DCGAN discriminator step's loss: real images as real, the generator's (no gradient) as fake."""

    def __init__(self, g: Generator, d: Discriminator) -> None:
        super().__init__()
        self.g, self.d = g, d

    def forward(self, real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            fake = self.g(z)
        real_logits, fake_logits = self.d(real), self.d(fake)
        return (F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits)) +
                F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits)))


class GeneratorLoss(nn.Module):
    def __init__(self, g: Generator, d: Discriminator) -> None:
        super().__init__()
        self.g, self.d = g, d

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        logits = self.d(self.g(z))
        return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))


def dcgan(seed: int = 0):
    torch.manual_seed(seed)
    g, d = Generator(), Discriminator()
    return g, d, torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.999)), \
        torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.999))


def test_a_dcgan_loop_with_adam_and_batch_norm_ends_on_the_local_loops_state_dict(client):
    g_here, d_here, opt_g_here, opt_d_here = dcgan()
    g, d, opt_g, opt_d = dcgan()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.rand(4, 1, 8, 8, generator=gen) * 2 - 1, torch.randn(4, 8, 1, 1, generator=gen))
               for _ in range(3)]
    for real, z in batches:
        for make, opt, args in ((DiscriminatorLoss, opt_d_here, (real, z)), (GeneratorLoss, opt_g_here, (z,))):
            opt.zero_grad()
            make(g_here, d_here)(*args).backward()
            opt.step()
        for make, opt, args in ((DiscriminatorLoss, opt_d, (real, z)), (GeneratorLoss, opt_g, (z,))):
            step = make(g, d)
            result = client.gradients(step, args, loss="output", numcheck="off")
            assert result.buffers  # forward's batch norm statistics came back and were written into g and d
            opt.zero_grad()
            result.set_grads(step)
            opt.step()
    assert_state_dicts_close(g.state_dict(), g_here.state_dict())
    assert_state_dicts_close(d.state_dict(), d_here.state_dict())


def test_update_buffers_false_leaves_the_modules_buffers_alone(client):
    g, d, _, _ = dcgan()
    before = {n: b.clone() for n, b in d.named_buffers()}
    result = client.gradients(GeneratorLoss(g, d), torch.randn(4, 8, 1, 1), loss="output", numcheck="off",
                              update_buffers=False)
    assert "d.main.3.running_mean" in result.buffers
    assert all(torch.equal(b, before[n]) for n, b in d.named_buffers())
