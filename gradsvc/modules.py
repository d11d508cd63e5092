"""The torch modules a spec names beyond torch.nn: Residual, and the recurrent layers reduced to their
output sequence. Shared by the engine and the SDK (both have torch); parameter names stay torch's."""

from __future__ import annotations

import torch
from torch import nn


class Residual(nn.Sequential):
    """x + f(x), with f the contained layers; names stay nn.Sequential's ("2.0.weight")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


class RNN(nn.RNN):
    """nn.RNN whose output is the output sequence alone (the final hidden state is dropped), so it fits a
    stack; parameters, defaults and initialisation are nn.RNN's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


class LSTM(nn.LSTM):
    """nn.LSTM whose output is the output sequence alone ((h_n, c_n) dropped)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


class GRU(nn.GRU):
    """nn.GRU whose output is the output sequence alone (h_n dropped)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


_OWN = {"RNN": RNN, "LSTM": LSTM, "GRU": GRU}


def layer_class(kind: str) -> type[nn.Module]:
    """The torch class an allow-listed layer type names."""
    return _OWN.get(kind) or getattr(nn, kind)
