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
Both loops end on weights equal to float32 rounding (printed). On a machine with a GPU the worker holds the session
on it and the local step runs on the same GPU (synchronised before each clock read), and GPT-2 small (124M, the
defaults) runs too; `--124m` runs it on a CPU as well.

Run: .venv/bin/python bench/session_step.py [steps] [--124m]
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

from common import footer, header, median, start_stack, sync, table
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


def _local_step(model: nn.Module, opt, ids, y, device: torch.device) -> float:
    ids, y = ids.to(device), y.to(device)
    sync(device)
    t0 = time.perf_counter()
    F.cross_entropy(model(ids), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    sync(device)
    return time.perf_counter() - t0


def main(steps: int = STEPS, gpt2_small: bool = False) -> list[list]:
    started = header("Session step: a GPT-2 step on the worker against the same step locally", __doc__.split("Run:")[0])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    configs = [("23M", GPT2_23M)] + ([("124M", {})] if device.type == "cuda" or gpt2_small else [])
    rows = []
    stack = start_stack(workers=1)
    try:
        for name, config in configs:
            rows += _one_model(stack, name, config, steps, device)
    finally:
        stack.stop()
    table(["model", "step", "median s", "mean s", "ratio", "up B", "down B"], rows)
    footer(started)
    return rows


def _one_model(stack, name: str, config: dict, steps: int, device: torch.device) -> list[list]:
    torch.manual_seed(0)
    vocab = config.get("vocab_size", 50257)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, vocab, (8, 128), generator=g), torch.randint(0, vocab, (1024,), generator=g))
               for _ in range(steps + 1)]
    batch_bytes = sum(x.numel() * x.element_size() for x in batches[0])
    model = GPT2LM(**config)
    local = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(local.parameters(), lr=3e-4)
    transport = Counting()
    with Client(stack.base_url, timeout=600, transport=transport) as client, \
            client.session(model, "adamw", lr=3e-4, clip=1.0) as s:
        s.step(*batches[0])  # export, upload, creation: not timed
        _local_step(local, opt, *batches[0], device)
        session_s, local_s, up, down = [], [], [], []
        for ids, y in batches[1:]:
            transport.up = transport.down = 0
            t0 = time.perf_counter()
            s.step(ids, y)
            session_s.append(time.perf_counter() - t0)
            up.append(transport.up)
            down.append(transport.down)
            local_s.append(_local_step(local, opt, ids, y, device))
        info = s.info()
        s.pull(model)
    diff = max((p - q.cpu()).abs().max().item() for p, q in zip(model.parameters(), local.parameters()))
    print(f"\n{name}: {steps} timed steps; {info.parameter_count / 1e6:.1f}M parameters, {info.state_bytes / 1e6:.0f} "
          f"MB of state on {info.device}, checkpoint every {info.checkpoint_every} steps. Per step the session sent "
          f"{median(up):.0f} bytes for a {batch_bytes}-byte batch: {median(up) - batch_bytes:.0f} bytes over it "
          f"(goal: under 4096), and got {median(down):.0f} back. Largest weight difference from local training: "
          f"{diff:.2e}.")
    return [[name, "session", median(session_s), statistics.mean(session_s), median(session_s) / median(local_s),
             median(up), median(down)],
            [name, "local", median(local_s), statistics.mean(local_s), 1.0, 0, 0]]


if __name__ == "__main__":
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    main(int(numbers[0]) if numbers else STEPS, "--124m" in sys.argv)
