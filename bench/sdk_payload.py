"""The SDK's payload throughput for a 10M-parameter gradient: MessagePack (raw bytes) vs JSON (base64).

One request = the model's 40 MB of float32 weights up, its 40 MB gradient down (nn.Linear(3162, 3162),
10,001,406 parameters, batch 2, numcheck off). For each wire format it prints:
  end-to-end  Client.gradients() wall time, and MB/s of tensor data moved (80 MB raw per call)
  wire MB     request + response bytes on the wire
  SDK codec   the SDK's own work (encode the request, decode the answer into torch tensors), MB/s
and the msgpack/JSON ratios. Starts a private stack (tests/support/stack.py) unless --base-url is given.

Run: .venv/bin/python bench/sdk_payload.py [--base-url URL] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from gradclient import Client  # noqa: E402
from gradclient.request import Call  # noqa: E402
from gradclient.result import build_result  # noqa: E402
from gradsvc import wire  # noqa: E402

WIDTH = 3162  # 3162 * 3162 + 3162 = 10,001,406 parameters
OPTIONS = {"numcheck": "off", "memory": False}


def measure(base_url: str, fmt: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, repeat: int) -> dict:
    raw_mb = 2 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6  # weights up + grads down
    with Client(base_url, wire_format=fmt, timeout=300) as client:
        client.gradients(model, x, y, **OPTIONS)  # warm-up: the worker's first job, allocator, connections
        walls, computes = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            result = client.gradients(model, x, y, **OPTIONS)
            walls.append(time.perf_counter() - t0)
            computes.append(result.timings.total_ms / 1e3)
        # The SDK's share: encode the request, then decode a captured answer into torch tensors.
        t0 = time.perf_counter()
        prepared = client._prepare(Call(model, x, y, seed=0, options=dict(OPTIONS)))
        encode_s = time.perf_counter() - t0
        response, buf = client._send("POST", "/gradients", content=prepared.content, params={"wait": 120},
                                     extra_s=120)
        t0 = time.perf_counter()
        build_result(client._reader.decode(wire.GradientResult, response, buf), prepared.local_names)
        decode_s = time.perf_counter() - t0
    wall = statistics.median(walls)
    return {"format": fmt, "wall_s": wall, "compute_s": statistics.median(computes), "raw_mb": raw_mb,
            "wire_mb": (len(prepared.content) + len(buf)) / 1e6, "e2e_mb_s": raw_mb / wall,
            "codec_s": encode_s + decode_s, "codec_mb_s": raw_mb / (encode_s + decode_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=None, help="a running service (default: start a private stack)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH))
    x, y = torch.randn(2, WIDTH), torch.tensor([0, 1])
    stack = None
    if args.base_url is None:
        from tests.support.stack import start_stack

        stack = start_stack(workers=1)
    try:
        url = args.base_url or stack.base_url
        rows = [measure(url, fmt, model, x, y, args.repeat) for fmt in ("msgpack", "json")]
    finally:
        if stack is not None:
            stack.stop()
    params = sum(p.numel() for p in model.parameters())
    print(f"SDK payload, {params:,} float32 parameters ({rows[0]['raw_mb']:.0f} MB of tensors per call), "
          f"median of {args.repeat}")
    print(f"{'format':<8} {'end-to-end s':>12} {'worker s':>9} {'e2e MB/s':>9} {'wire MB':>8} {'SDK codec s':>12} "
          f"{'codec MB/s':>11}")
    for r in rows:
        print(f"{r['format']:<8} {r['wall_s']:>12.3f} {r['compute_s']:>9.3f} {r['e2e_mb_s']:>9.0f} "
              f"{r['wire_mb']:>8.1f} {r['codec_s']:>12.3f} {r['codec_mb_s']:>11.0f}")
    mp, js = rows
    print(f"msgpack/JSON: end-to-end {mp['e2e_mb_s'] / js['e2e_mb_s']:.1f}x the throughput, "
          f"SDK codec {mp['codec_mb_s'] / js['codec_mb_s']:.1f}x, {js['wire_mb'] / mp['wire_mb']:.2f}x fewer bytes")


if __name__ == "__main__":
    main()
