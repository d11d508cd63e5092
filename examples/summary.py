"""One result, seen: a small CNN's per-layer table printed (`print(result)`) and drawn as a PNG.

    .venv/bin/python examples/summary.py --base-url http://127.0.0.1:8000 --out /tmp/result.png

Without --out the chart goes into a new temporary directory (its path is printed); --out '' skips it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn

from gradclient import Client


def main(base_url: str | None = None, out: str | Path | None = None, verbose: bool = True, plot: bool = True):
    """Print the result's table; with `plot`, save the chart to `out` (default: result.png in a new temp dir)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    x = torch.randn(32, 1, 28, 28)  # (batch, channels, height, width)
    y = torch.randint(0, 10, (32,))
    with Client(base_url) as client:
        result = client.gradients(model, x, y, loss="cross_entropy", numcheck="sampled")
    if verbose:
        print(result)
    if plot:
        path = Path(out) if out else Path(tempfile.mkdtemp(prefix="gradsvc-summary-")) / "result.png"
        result.plot(str(path))
        if verbose:
            print(f"saved {path}")
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="the service (default $GRADSVC_URL or http://127.0.0.1:8000)")
    ap.add_argument("--out", default=None,
                    help="where to save the chart (PNG; default: result.png in a new temporary directory); '' skips it")
    args = ap.parse_args()
    main(args.base_url, args.out, plot=args.out != "")
