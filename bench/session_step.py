"""A training step through a session against the same step run locally, side by side in one run: a ~23M-parameter
GPT-2 (6 layers, width 512, vocabulary 8,192, built from a config as bench/large_model.py builds it; nothing
downloaded), batch 8 x 128 tokens, float32, every position's next-token loss, AdamW (lr 3e-4), clipped at norm
1.0, one worker.

"session s" is a step through the SDK (`s.step(ids, y)`: the batch goes up, the loss and grad_norm come back; the
worker runs forward, backward, clip, AdamW); "local s" the same step in this process (forward, backward,
clip_grad_norm_, AdamW). Steps alternate (session, local, session, ...) so that load hits both alike; the first
step of each (the export, the session's creation) is not timed. "median" and "mean" over the timed steps: the mean
counts the checkpoints (every checkpoint_every steps, default from the state's size). "up B" and "down B" are the
bytes on the wire per session step (request and answer: body and HTTP head), against the batch's own bytes.
Both loops end on weights equal to float32 rounding (printed).

Run: .venv/bin/python bench/session_step.py [steps]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import torch
import torch.nn.functional as F
from torch import nn

from common import footer, header, median, start_stack, table
from gradclient import Client
from tests.support.models import GPT2_23M, GPT2LM

STEPS = 12


class Counting(httpx.HTTPTransport):
    """An HTTP transport that counts the bytes of each request and answer (head and body)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = self.down = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        head = f"{request.method} {request.url.raw_path.decode()} HTTP/1.1\r\n".encode()
        head += b"".join(k + b": " + v + b"\r\n" for k, v in request.headers.raw) + b"\r\n"
        self.up += len(head) + len(request.read())
        response = super().handle_request(request)
        body = response.read()
        self.down += len(body) + sum(len(k) + len(v) + 4 for k, v in response.headers.raw) + 17
        return httpx.Response(response.status_code, headers=response.headers, content=body,
                              extensions=response.extensions)


def _local_step(model: nn.Module, opt, ids, y) -> float:
    t0 = time.perf_counter()
    F.cross_entropy(model(ids), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def main(steps: int = STEPS) -> list[list]:
    started = header("Session step: a 23M GPT-2 step on the worker against the same step locally",
                     __doc__.split("Run:")[0])
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 8192, (8, 128), generator=g), torch.randint(0, 8192, (1024,), generator=g))
               for _ in range(steps + 1)]
    batch_bytes = sum(x.numel() * x.element_size() for x in batches[0])
    model = GPT2LM(**GPT2_23M)
    local = copy.deepcopy(model)
    opt = torch.optim.AdamW(local.parameters(), lr=3e-4)
    stack = start_stack(workers=1)
    transport = Counting()
    try:
        with Client(stack.base_url, timeout=600, transport=transport) as client, \
                client.session(model, "adamw", lr=3e-4, clip=1.0) as s:
            s.step(*batches[0])  # export, upload, creation: not timed
            _local_step(local, opt, *batches[0])
            session_s, local_s, up, down = [], [], [], []
            for ids, y in batches[1:]:
                transport.up = transport.down = 0
                t0 = time.perf_counter()
                s.step(ids, y)
                session_s.append(time.perf_counter() - t0)
                up.append(transport.up)
                down.append(transport.down)
                local_s.append(_local_step(local, opt, ids, y))
            info = s.info()
            s.pull(model)
    finally:
        stack.stop()
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), local.parameters()))
    rows = [["session", median(session_s), statistics.mean(session_s), median(session_s) / median(local_s),
             median(up), median(down)],
            ["local", median(local_s), statistics.mean(local_s), 1.0, 0, 0]]
    table(["step", "median s", "mean s", "ratio", "up B", "down B"], rows)
    print(f"\n{steps} timed steps; {info.parameter_count / 1e6:.1f}M parameters, {info.state_bytes / 1e6:.0f} MB of "
          f"state on {info.device}, checkpoint every {info.checkpoint_every} steps. Per step the session sent "
          f"{median(up):.0f} bytes for a {batch_bytes}-byte batch: {median(up) - batch_bytes:.0f} bytes over it "
          f"(goal: under 4096), and got {median(down):.0f} back. Largest weight difference from local training: "
          f"{diff:.2e}.")
    footer(started)
    return rows


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else STEPS)
