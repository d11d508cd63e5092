"""Models with their own forward (the families graph specs must serve), each with an example batch.

Shared by the engine tests (tests/engine/test_graph.py), the exporter tests and the live-stack tests.
Dropout is 0 where gradients are compared (BatchNorm stays in training mode).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class ResNetBlock(nn.Module):
    """A ResNet basic block: conv-bn-relu-conv-bn, plus the input, relu."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        y = torch.relu(x + y)  # (batch, channels, h, w)
        return self.head(y.mean(dim=(2, 3)))  # (batch, 3)


class UNetSkip(nn.Module):
    """Down, up, and a skip joined by concatenation along the channels."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(2, 4, 3, padding=1)
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.relu(self.enc(x))
        m = torch.relu(self.mid(self.down(e)))
        return self.dec(torch.cat([self.up(m), e], dim=1)).flatten(1)  # (batch, 2*h*w)


class PreNormBlock(nn.Module):
    """A pre-norm transformer block with nn.MultiheadAttention, a learned class token and a positional table."""

    def __init__(self, dim: int = 8, heads: int = 2, seq: int = 5) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, seq + 1, dim) * 0.1)
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # (batch, seq+1, dim)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x[:, 0])  # (batch, 3)


class EncoderClassifier(nn.Module):
    """torch's nn.TransformerEncoder, mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def bert() -> nn.Module:
    import transformers

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def llama() -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
                                   use_cache=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return transformers.LlamaForCausalLM(cfg)


def gpt2() -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg)


def vit() -> nn.Module:
    import transformers

    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32, num_labels=3,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg)


def _tokens(batch: int, seq: int = 7) -> torch.Tensor:
    return torch.randint(0, 50, (batch, seq))


# name -> (builder, example batch maker(batch size)); models are built in training mode.
FAMILIES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    "resnet_block": (ResNetBlock, lambda b: torch.randn(b, 4, 6, 6)),
    "unet_skip": (UNetSkip, lambda b: torch.randn(b, 2, 8, 8)),
    "prenorm_block": (PreNormBlock, lambda b: torch.randn(b, 5, 8)),
    "transformer_encoder": (EncoderClassifier, lambda b: torch.randn(b, 5, 8)),
    "hf_bert": (bert, _tokens),
    "hf_llama": (llama, _tokens),
    "hf_gpt2": (gpt2, _tokens),
    "hf_vit": (vit, lambda b: torch.randn(b, 3, 8, 8)),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    make, batch = FAMILIES[name]
    torch.manual_seed(seed)
    model = make().train()
    return model, batch(4)
