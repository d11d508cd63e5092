"""The model zoo: models with their own forward, of several families, tiny enough for an exact float64
check, each defined once.

Each entry of CASES builds (model, inputs, targets, loss): the model seeded, in training mode unless it
says otherwise, dropout off where gradients are compared (BatchNorm stays in training mode). `build`
gives (model, inputs) for the tests that export or run a model without a loss. Shared by the engine
tests (tests/gradsvc/engine), the exporter tests (tests/gradclient/test_export.py), the live-stack tests
(tests/integration/test_any_model.py, test_numcheck_trust.py) and the benches (bench/numcheck_auto.py,
bench/graph_interpreter.py, bench/graph_overhead.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class ResNetBlock(nn.Module):
    """A ResNet basic block (conv, batch norm, relu(x + f(x))), mean-pooled into a linear head; BatchNorm
    trains."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        h = torch.relu(x + h)  # (batch, channels, h, w)
        return self.head(h.mean(dim=(2, 3)))  # (batch, 3)


class UNetSkip(nn.Module):
    """A U-Net step: down (max pool), up (transposed conv), and the skip joined by concatenation along
    channels."""

    def __init__(self, c: int = 2) -> None:
        super().__init__()
        self.enc = nn.Conv2d(c, 4, 3, padding=1)
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.dec = nn.Conv2d(8, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.enc(x))  # (batch, 4, h, w)
        h = self.up(torch.tanh(self.mid(self.down(skip))))  # (batch, 4, h, w)
        return self.dec(torch.cat([skip, h], dim=1))  # (batch, c, h, w)


class PreNormBlock(nn.Module):
    """A pre-norm transformer block with nn.MultiheadAttention, a learned class token and a positional table."""

    def __init__(self, dim: int = 8, heads: int = 2, seq: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, seq + 1, dim) * 0.1)
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # (batch, seq+1, dim)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x[:, 0])  # (batch, classes)


class Encoder(nn.Module):
    """torch's nn.TransformerEncoder (two layers, dropout off) and a mean-pooled head."""

    def __init__(self, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))  # (batch, classes)


class TinyLlama(nn.Module):
    """Hugging Face Llama from a config (nothing downloaded): the last position's next-token logits."""

    def __init__(self, vocab: int = 16, hidden: int = 8, layers: int = 1) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.lm = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                               num_hidden_layers=layers, num_attention_heads=2,
                                               num_key_value_heads=1, max_position_embeddings=16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits[:, -1, :]  # (batch, vocab)


class TinyBert(nn.Module):
    """Hugging Face BERT for sequence classification from a config, dropout off."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        self.bert = BertForSequenceClassification(BertConfig(
            vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids).logits  # (batch, 3)


class RecurrentLM(nn.Module):
    """Embedding -> nn.GRU / nn.LSTM / nn.RNN (two layers) -> Linear: the next token's logits after the
    last position. With batch_first False the sequence is transposed in and out, as such code does."""

    def __init__(self, cell: str = "gru", batch_first: bool = True, vocab: int = 16, dim: int = 6,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(vocab, dim)
        kind, _, nonlinearity = cell.partition("_")
        extra = {"nonlinearity": nonlinearity} if kind == "rnn" else {}
        self.rnn = {"gru": nn.GRU, "lstm": nn.LSTM, "rnn": nn.RNN}[kind](dim, dim, num_layers=2, dropout=dropout,
                                                                        batch_first=batch_first, **extra)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (batch, seq, dim)
        out = self.rnn(h if self.batch_first else h.transpose(0, 1))[0]
        out = out if self.batch_first else out.transpose(0, 1)  # (batch, seq, dim)
        return self.head(out[:, -1])  # (batch, vocab)


class SmallTransformer(nn.Module):
    """Token ids -> logits: embedding, a learned position table, pre-norm nn.TransformerEncoder layers; a
    head over the vocabulary at every position (classes=None), or over `classes` of the mean-pooled tokens.
    The benches' mid-size model (bench/graph_interpreter.py, bench/graph_overhead.py)."""

    def __init__(self, dim: int = 64, layers: int = 2, vocab: int = 100, classes: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, 32, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooled = classes is not None
        self.head = nn.Linear(dim, vocab if classes is None else classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(ids) + self.pos[:, : ids.shape[1]])  # (batch, seq, dim)
        return self.head(h.mean(1) if self.pooled else h)  # (batch, classes) or (batch, seq, vocab)


# GPT-2 at 23M parameters (6 layers, width 512, vocabulary 8,192, 128 positions): the benches' and the sessions' model.
GPT2_23M = {"vocab_size": 8192, "n_positions": 128, "n_embd": 512, "n_layer": 6, "n_head": 8, "bos_token_id": 0,
            "eos_token_id": 0}


class GPT2LM(nn.Module):
    """Hugging Face GPT-2 from a config (`config`: GPT2Config's arguments; none: GPT-2 small, 124M), dropout off:
    every position's next-token logits, flattened to (batch*seq, vocab), the standard causal LM loss."""

    def __init__(self, **config) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.lm = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **config))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits.flatten(0, 1)  # (batch*seq, vocab)


class EveryPositionGPT2(GPT2LM):
    """The zoo's GPT-2: one layer of width 8 over 16 tokens."""

    def __init__(self) -> None:
        super().__init__(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)


class TinyViT(nn.Module):
    """Hugging Face ViT for image classification from a config (4x4 patches of an 8x8 image), dropout off."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        self.vit = ViTForImageClassification(ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=pixels).logits  # (batch, 3)


class TinyConvNext(nn.Module):
    """Hugging Face ConvNeXt for image classification from a config (depthwise 7x7 convs, LayerNorm, GELU)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ConvNextConfig, ConvNextForImageClassification

        self.net = ConvNextForImageClassification(ConvNextConfig(
            num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[4, 8], depths=[1, 1], num_labels=3,
            drop_path_rate=0.0))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=pixels).logits  # (batch, 3)


class MobileNetSE(nn.Module):
    """A MobileNetV3-style block: pointwise expand, depthwise conv, BatchNorm (training: batch statistics),
    squeeze-excite, pointwise project, a residual; the convs before BatchNorm have biases, whose gradient
    BatchNorm makes exactly zero."""

    def __init__(self, c: int = 3, expand: int = 6) -> None:
        super().__init__()
        self.expand = nn.Conv2d(c, expand, 1)
        self.depthwise = nn.Conv2d(expand, expand, 3, padding=1, groups=expand)
        self.bn = nn.BatchNorm2d(expand)
        self.squeeze = nn.Linear(expand, 2)
        self.excite = nn.Linear(2, expand)
        self.project = nn.Conv2d(expand, c, 1)
        self.head = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.hardswish(self.bn(self.depthwise(self.expand(x))))  # (batch, expand, H, W)
        w = torch.sigmoid(self.excite(torch.relu(self.squeeze(h.mean((2, 3))))))  # (batch, expand)
        out = x + self.project(h * w[:, :, None, None])
        return self.head(out.mean((2, 3)))  # (batch, 3)


Case = tuple[nn.Module, torch.Tensor, torch.Tensor, str]


def _case(cls: Callable[[], nn.Module], inputs: Callable[[torch.Generator], torch.Tensor],
          targets: Callable[[torch.Generator], torch.Tensor], loss: str) -> Callable[[torch.dtype], Case]:
    def make(dtype: torch.dtype = torch.float32) -> Case:
        torch.manual_seed(0)
        model = cls().to(dtype)
        gen = torch.Generator().manual_seed(1)
        x = inputs(gen)
        x = x.to(dtype) if x.dtype.is_floating_point else x
        y = targets(gen)
        return model, x, (y.to(dtype) if y.dtype.is_floating_point else y), loss
    return make


CASES: dict[str, Callable[[torch.dtype], Case]] = {
    "resnet_block": _case(ResNetBlock, lambda g: torch.randn(4, 4, 6, 6, generator=g),
                          lambda g: torch.randint(0, 3, (4,), generator=g), "cross_entropy"),
    "unet_skip": _case(UNetSkip, lambda g: torch.randn(2, 2, 4, 4, generator=g),
                       lambda g: torch.randn(2, 2, 4, 4, generator=g), "mse"),
    "prenorm_block": _case(PreNormBlock, lambda g: torch.randn(2, 5, 8, generator=g),
                           lambda g: torch.randint(0, 3, (2,), generator=g), "cross_entropy"),
    "transformer_encoder": _case(Encoder, lambda g: torch.randn(2, 3, 8, generator=g),
                                 lambda g: torch.randint(0, 3, (2,), generator=g), "cross_entropy"),
    "hf_llama": _case(TinyLlama, lambda g: torch.randint(0, 16, (2, 4), generator=g),
                      lambda g: torch.randint(0, 16, (2,), generator=g), "cross_entropy"),
    "gru_lm": _case(RecurrentLM, lambda g: torch.randint(0, 16, (3, 5), generator=g),
                    lambda g: torch.randint(0, 16, (3,), generator=g), "cross_entropy"),
    "lstm_lm": _case(lambda: RecurrentLM("lstm"), lambda g: torch.randint(0, 16, (3, 5), generator=g),
                     lambda g: torch.randint(0, 16, (3,), generator=g), "cross_entropy"),
    "hf_bert": _case(TinyBert, lambda g: torch.randint(0, 16, (2, 4), generator=g),
                     lambda g: torch.randint(0, 3, (2,), generator=g), "cross_entropy"),
    "hf_gpt2_every_position": _case(EveryPositionGPT2, lambda g: torch.randint(0, 16, (2, 5), generator=g),
                                    lambda g: torch.randint(0, 16, (10,), generator=g), "cross_entropy"),
    "hf_vit": _case(TinyViT, lambda g: torch.randn(2, 3, 8, 8, generator=g),
                    lambda g: torch.randint(0, 3, (2,), generator=g), "cross_entropy"),
    "hf_convnext": _case(TinyConvNext, lambda g: torch.randn(2, 3, 8, 8, generator=g),
                         lambda g: torch.randint(0, 3, (2,), generator=g), "cross_entropy"),
    "mobilenet_se": _case(MobileNetSE, lambda g: torch.randn(4, 3, 4, 4, generator=g),
                          lambda g: torch.randint(0, 3, (4,), generator=g), "cross_entropy"),
}


def build(name: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.Tensor]:
    """CASES[name]'s model and inputs, for the tests that export or run it without a loss."""
    model, x, _, _ = CASES[name](dtype)
    return model, x


def local_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str) -> dict[str, torch.Tensor]:
    """The answer key: eager autograd on a copy (running statistics of the original are left alone)."""
    import copy

    import torch.nn.functional as F

    m = copy.deepcopy(model)
    out = m(x)
    value = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss}[loss](out, y)
    params = {n: p for n, p in m.named_parameters() if p.requires_grad}
    return dict(zip(params, torch.autograd.grad(value, list(params.values()))))


class VectorField(nn.Module):
    """dy/dt = f(t, y): a small MLP of the state (time-invariant, as many neural ODE examples write it)."""

    def __init__(self, dim: int = 2, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))

    def forward(self, t: float, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)


class NeuralODE(nn.Module):
    """A fixed-step RK4 integrator in plain torch over a VectorField, as public neural-ODE tutorials write it: the
    trajectory goes into a preallocated tensor (torch.zeros, then ys[i + 1] = y: select and copy_ in the graph),
    and the model reads the trajectory's mean."""

    def __init__(self, dim: int = 2, steps: int = 20) -> None:
        super().__init__()
        self.field = VectorField(dim)
        self.steps = steps

    def forward(self, y0: torch.Tensor) -> torch.Tensor:
        h = 1.0 / self.steps
        ys = torch.zeros(self.steps + 1, *y0.shape, dtype=y0.dtype)
        ys[0] = y0
        y, t = y0, 0.0
        for i in range(self.steps):
            k1 = self.field(t, y)
            k2 = self.field(t + h / 2, y + h / 2 * k1)
            k3 = self.field(t + h / 2, y + h / 2 * k2)
            k4 = self.field(t + h, y + h * k3)
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            t += h
            ys[i + 1] = y
        return ys.mean(0)
