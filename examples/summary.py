"""One result, seen: a small CNN's per-layer table printed (`print(result)`) and drawn as a PNG.

    python examples/summary.py --base-url http://127.0.0.1:8000 --out result.png
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from gradclient import Client


def main(base_url: str | None = None, out: str | None = "result.png", verbose: bool = True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    x = torch.randn(32, 1, 28, 28)  # (batch, channels, height, width)
    y = torch.randint(0, 10, (32,))
    with Client(base_url) as client:
        result = client.gradients(model, x, y, loss="cross_entropy", numcheck="sampled")
    if verbose:
        print(result)
    if out:
        result.plot(out)
        if verbose:
            print(f"saved {out}")
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="the service (default $GRADSVC_URL or http://127.0.0.1:8000)")
    ap.add_argument("--out", default="result.png", help="where to save the chart (PNG); '' to skip it")
    args = ap.parse_args()
    main(args.base_url, args.out or None)
