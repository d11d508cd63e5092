"""A ~25M-parameter GPT-2 (6 layers, width 512, vocabulary 8,192, built from a config; nothing downloaded),
batch 8 x 128 tokens, float32, every position's next-token loss, through the SDK against a live stack (one
worker, handoff on as `gradsvc up` sets it), against the same step locally, in the same run:

- full step: every weight trains (SGD), so every weight changes and goes up again each step;
- frozen backbone: only the last block and the head train, the rest goes up once, by reference;
- fixed-weights sweep: per-sample gradient norms over 16 batches with unchanged weights (nothing goes up
  again but the batch), `per_sample="norms", batch_gradient=False` (the batch's gradient neither computed
  nor returned). Local: what a PyTorch user writes for it, `torch.func.vmap(grad(loss of one example))`
  over `functional_call`, then each example's norm (`torch.linalg.vector_norm`, as the service computes it).

"service s" is the median wall time of a step through the SDK (after a first, untimed call that exports
and uploads); "local s" the median of the same step in this process (forward, backward, optimizer step; the sweep: per batch);
"worker s" the median of the worker's own timings.total_ms (its compute: prepare, forward, backward);
"sent MB" what the SDK sent per timed step (body and pieces). numcheck off, memory accounting off.

Run: .venv/bin/python bench/large_model.py
"""

from __future__ import annotations

import copy
import time

import common  # noqa: F401  (puts the repo on sys.path)
import torch
import torch.nn.functional as F
from torch import nn

from common import footer, header, median, start_stack, table
from gradclient import Client
from tests.support.models import GPT2_23M, GPT2LM

STEPS = 5
SWEEP_BATCHES = 16


def _freeze_backbone(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("lm.transformer.h.5.", "lm.transformer.ln_f.")))


def _step(model, client, ids, y, opt, options) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    result = client.gradients(model, ids, y, numcheck="off", memory=False, **options)
    if opt is not None:
        result.set_grads(model)
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - t0, result.upload_bytes, result.timings.total_ms / 1e3


def _local_step(model, ids, y, opt, per_sample: bool) -> float:
    t0 = time.perf_counter()
    if per_sample:
        from torch.func import functional_call, grad, vmap

        params = {n: p.detach() for n, p in model.named_parameters()}

        def one(ps, x, t):
            return F.cross_entropy(functional_call(model, ps, (x.unsqueeze(0),)), t)

        n = ids.shape[0]
        grads = vmap(grad(one), in_dims=(None, 0, 0))(params, ids, y.reshape(n, -1))
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.reshape(n, -1), dim=1)
                                              for g in grads.values()]), dim=0)
    else:
        F.cross_entropy(model(ids), y).backward()
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - t0


def main() -> list[list]:
    started = header("Large model: a 25M-parameter GPT-2 through the service against local, weights by reference",
                     __doc__.split("Run:")[0])
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 8192, (8, 128), generator=g), torch.randint(0, 8192, (1024,), generator=g))
               for _ in range(SWEEP_BATCHES)]
    stack = start_stack(workers=1, handoff=True)
    rows = []
    try:
        with Client(stack.base_url, timeout=600) as client:
            for case in ("full step", "frozen backbone", "fixed-weights sweep"):
                model = GPT2LM(**GPT2_23M)
                if case == "frozen backbone":
                    _freeze_backbone(model)
                local = copy.deepcopy(model)
                trainable = [p for p in model.parameters() if p.requires_grad]
                sweep = case == "fixed-weights sweep"
                opt = None if sweep else torch.optim.SGD(trainable, lr=1e-3)
                local_opt = None if sweep else torch.optim.SGD([p for p in local.parameters() if p.requires_grad],
                                                               lr=1e-3)
                options = {"per_sample": "norms", "batch_gradient": False} if sweep else {}
                ids, y = batches[0]
                _step(model, client, ids, y, opt, options)  # export, upload
                service, sent, worker, local_s = [], [], [], []
                for k in range(STEPS if not sweep else len(batches)):
                    ids, y = batches[k % len(batches)]
                    s, b, w = _step(model, client, ids, y, opt, options)
                    service.append(s)
                    sent.append(b)
                    worker.append(w)
                    local_s.append(_local_step(local, ids, y, local_opt, sweep))
                rows.append([case, sum(p.numel() for p in trainable) / 1e6 if not sweep else 0.0,
                             median(service), median(worker), median(local_s), median(service) / median(local_s),
                             median(sent) / 1e6])
    finally:
        stack.stop()
    table(["case", "trainable M", "service s", "worker s", "local s", "ratio", "sent MB"], rows)
    footer(started)
    return rows


if __name__ == "__main__":
    main()
