"""Public-style training code as its authors write it (nanoGPT's attention, the examples repository's VAE and
LSTMCell time series, Llama's rotary embedding, a Siamese net), small configs, for the graph tests."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: SDPA, then transpose(1, 2).contiguous().view(B, T, C)."""

    def __init__(self, n_embd: int = 16, n_head: int = 4) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class VAE(nn.Module):
    """pytorch/examples' VAE (smaller), its BCE + KL loss computed inside forward."""

    def __init__(self, n_in: int = 20) -> None:
        super().__init__()
        self.n_in = n_in
        self.fc1, self.fc21, self.fc22 = nn.Linear(n_in, 12), nn.Linear(12, 4), nn.Linear(12, 4)
        self.fc3, self.fc4 = nn.Linear(4, 12), nn.Linear(12, n_in)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.encode(x.view(-1, self.n_in))
        recon = self.decode(self.reparameterize(mu, logvar))
        bce = F.binary_cross_entropy(recon, x.view(-1, self.n_in), reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return bce + kld


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RotaryAttention(nn.Module):
    """Llama's attention with its complex rotary table: a buffer (torchtitan) or a plain attribute (Meta's
    reference code, a constant of the exported graph)."""

    def __init__(self, dim: int = 16, n_heads: int = 2, max_seq: int = 8, table: str = "buffer") -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wv, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        freqs = precompute_freqs_cis(self.head_dim, max_seq)
        if table == "buffer":
            self.register_buffer("freqs_cis", freqs, persistent=False)
        else:
            self.freqs_cis = freqs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, self.freqs_cis[:seqlen])
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        out = torch.matmul(scores, xv).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)


class Siamese(nn.Module):
    """A Siamese net scoring pairs by cosine similarity."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.cosine_similarity(self.net(a), self.net(b))  # (batch,)


class Sequence(nn.Module):
    """pytorch/examples' time_sequence_prediction: two LSTMCells in a Python loop over time."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.hidden = hidden
        self.lstm1, self.lstm2 = nn.LSTMCell(1, hidden), nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        outputs = []
        h_t = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        c_t = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        h_t2 = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        c_t2 = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        return torch.cat(outputs, dim=1)  # (batch, steps)


class Noisy(nn.Module):
    """Every random op forward may call: noise injection, stochastic depth, sampled masks and permutations."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = h + 0.1 * torch.randn_like(h) + 0.1 * torch.rand_like(h)
        h = h + 0.1 * torch.randn(h.shape[1]) + 0.05 * torch.rand(h.shape[1])
        keep = torch.bernoulli(torch.full_like(h, 0.8))  # (batch, 6)
        h = h * keep + 0.1 * torch.normal(h.detach(), 0.5)
        scale = torch.empty(h.shape[0], 1).bernoulli_(0.9) / 0.9  # stochastic depth (timm's drop_path)
        h = h * scale
        cols = torch.randperm(h.shape[1])
        picked = torch.multinomial(torch.softmax(h.detach(), -1), 2)  # (batch, 2)
        h = h[:, cols] + 0.01 * torch.randint(0, 3, h.shape).to(h.dtype) + 0.01 * picked.sum(1, keepdim=True)
        return torch.tanh(h)


class SpectralMix(nn.Module):
    """A complex input (a signal's spectrum) rotated by a complex table, read back as real features."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.register_buffer("phase", torch.polar(torch.ones(n), torch.arange(float(n))))
        self.head = nn.Linear(2 * n, 3)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.head(torch.view_as_real(z * self.phase).flatten(1))  # (batch, 3)


class GCN(nn.Module):
    """Two graph convolutions over a normalised (sparse) adjacency, as the official GCN example writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.gc1 = nn.Linear(5, 8)
        self.gc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.spmm(adj, self.gc1(x)))  # (nodes, 8)
        return F.log_softmax(torch.spmm(adj, self.gc2(h)), dim=1)  # (nodes, 3)


def normalised_adjacency(nodes: int = 7) -> torch.Tensor:
    """A random graph's adjacency with self-loops, symmetric, row-normalised (dense: callers pick the layout)."""
    g = torch.Generator().manual_seed(2)
    a = (torch.rand(nodes, nodes, generator=g) < 0.3).float() + torch.eye(nodes)
    a = ((a + a.T) > 0).float()
    return a / a.sum(1, keepdim=True)
