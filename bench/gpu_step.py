"""A training step of GPT-2 (built from a transformers config; nothing downloaded) on the worker's device (CUDA when
this machine has it, else the CPU), side by side in one run: the step run locally in this process, and the same
step through the service (a live stack: the API, Redis, one worker, handoff on, as `gradsvc up` starts it; the SDK
sends weights by reference). Batch 8 x 128 tokens, every position's next-token loss, float32, numcheck off, memory
accounting off. Three cases per model:

- full: every weight trains (SGD), so every weight changes and goes up again each step;
- frozen: only the last block and the final norm train, the backbone goes up once, by reference;
- fixed: the same weights every step, a new batch each time (a probe or an evaluation sweep): nothing but the batch
  goes up, and the worker holds the whole model (`prepared` resident, nothing copied).

Columns: "local ms" the local forward+backward (what the worker computes); the worker's own phases from
`timings` (prepare, forward, backward, total); "service ms" a step through the SDK (the call, and for full/frozen the
gradients written and the optimizer's step, as the local loop's step also does); "sent MB" and "recv MB" what the
SDK sent (body and pieces) and received per step; `prepared` and "copied MB" what the worker did to have the
model on its device; "worker/local" and "service/local" the ratios (local: forward+backward, and the local step
with its optimizer step). Medians of STEPS steps after one untimed step (export, upload, build).

GPT-2 23M (6 layers, width 512, vocabulary 8,192) always; GPT-2 small (124M, the defaults) on a GPU, or on a CPU
with --124m.

Run: .venv/bin/python bench/gpu_step.py [--124m] [--steps N] [--cases full,frozen,fixed]
"""

from __future__ import annotations

import argparse
import copy
import time

import common  # noqa: F401  (puts the repo on sys.path)
import httpx
import torch
import torch.nn.functional as F
from torch import nn

from common import footer, header, median, start_stack, sync, table
from gradclient import Client
from tests.support.models import GPT2_23M, GPT2LM

STEPS = 4
BATCH, SEQ = 8, 128
SMALL = GPT2_23M  # 23M parameters


class Counting(httpx.HTTPTransport):
    """The SDK's transport, counting the bytes of the answers it receives (their Content-Length)."""

    received = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.received += int(response.headers.get("content-length") or 0)
        return response


def _trainable(model: GPT2LM, case: str) -> list[nn.Parameter]:
    last = model.lm.config.n_layer - 1
    for name, p in model.named_parameters():
        p.requires_grad_(case == "full" or name.startswith((f"lm.transformer.h.{last}.", "lm.transformer.ln_f.")))
    return [p for p in model.parameters() if p.requires_grad]


def _local(model: GPT2LM, ids, y, opt, device: torch.device) -> tuple[float, float]:
    """(forward+backward s, the whole step s: with the optimizer's step when there is one)."""
    ids, y = ids.to(device), y.to(device)
    sync(device)
    t0 = time.perf_counter()
    F.cross_entropy(model(ids), y).backward()
    sync(device)
    fb = time.perf_counter() - t0
    if opt is not None:
        opt.step()
        opt.zero_grad()
        sync(device)
    else:
        model.zero_grad()
    return fb, time.perf_counter() - t0


def _service(client: Client, transport: Counting, model: GPT2LM, ids, y, opt) -> dict:
    before = transport.received
    t0 = time.perf_counter()
    result = client.gradients(model, ids, y, numcheck="off", memory=False)
    if opt is not None:
        result.set_grads(model)
        opt.step()
        opt.zero_grad()
    t = result.timings
    return {"service": time.perf_counter() - t0, "prepare": t.prepare_ms, "forward": t.forward_ms,
            "backward": t.backward_ms, "total": t.total_ms, "sent": result.upload_bytes,
            "received": transport.received - before, "prepared": result.prepared,
            "copied": result.copied_bytes or 0}


def run_case(client: Client, transport: Counting, config: dict, case: str, device: torch.device,
             batches: list, steps: int) -> list:
    torch.manual_seed(0)
    model = GPT2LM(**config)
    trainable = _trainable(model, case)
    local = copy.deepcopy(model).to(device)
    opt = None if case == "fixed" else torch.optim.SGD(trainable, lr=1e-3)
    local_opt = None if case == "fixed" else torch.optim.SGD([p for p in local.parameters() if p.requires_grad],
                                                             lr=1e-3)
    _service(client, transport, model, *batches[0], opt)  # export, upload, build: untimed
    _local(local, *batches[0], local_opt, device)
    rows = []
    for k in range(steps):
        ids, y = batches[(k + 1) % len(batches)]
        s = _service(client, transport, model, ids, y, opt)
        s["local_fb"], s["local_step"] = _local(local, ids, y, local_opt, device)
        rows.append(s)
    m = {k: median([r[k] for r in rows]) for k in rows[0] if k != "prepared"}
    prepared = "/".join(sorted({r["prepared"] or "-" for r in rows}))
    params = sum(p.numel() for p in model.parameters())
    return [f"{params / 1e6:.0f}M {case}", 1e3 * m["local_fb"], m["prepare"], m["forward"], m["backward"], m["total"],
            1e3 * m["service"], m["sent"] / 1e6, m["received"] / 1e6, prepared, m["copied"] / 1e6,
            m["total"] / (1e3 * m["local_fb"]), m["service"] / m["local_step"]]


def main() -> list[list]:
    parser = argparse.ArgumentParser(description="GPT-2 steps locally and through the service, side by side")
    parser.add_argument("--124m", dest="gpt2_small", action="store_true", help="GPT-2 small on a CPU too")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--cases", default="full,frozen,fixed", help="a comma-separated subset of full,frozen,fixed")
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    started = header(f"GPU step: GPT-2 locally and through the service on {device}", __doc__.split("Run:")[0])
    g = torch.Generator().manual_seed(0)
    configs = [SMALL] + ([{}] if device.type == "cuda" or args.gpt2_small else [])
    stack = start_stack(workers=1, handoff=True)
    rows = []
    transport = Counting()
    try:
        with Client(stack.base_url, timeout=900, transport=transport) as client:
            for config in configs:
                vocab = config.get("vocab_size", 50257)
                batches = [(torch.randint(0, vocab, (BATCH, SEQ), generator=g),
                            torch.randint(0, vocab, (BATCH * SEQ,), generator=g)) for _ in range(args.steps + 1)]
                for case in args.cases.split(","):
                    rows.append(run_case(client, transport, config, case, device, batches, args.steps))
                    print(f"  {rows[-1][0]}: worker {rows[-1][5]:.1f} ms, local {rows[-1][1]:.1f} ms", flush=True)
    finally:
        stack.stop()
    table(["model, case", "local ms", "prepare ms", "forward ms", "backward ms", "worker ms", "service ms", "sent MB",
           "recv MB", "prepared", "copied MB", "worker/local", "service/local"], rows)
    footer(started)
    return rows


if __name__ == "__main__":
    main()
