"""LoRA adapters on one base: N sessions of `peft` LoRA (rank 8 on `c_attn`) over one GPT-2 base on one CPU worker,
built as users build them (`get_peft_model` over a transformers GPT-2 from a config: nothing downloaded). Prints
the worker's resident memory (VmRSS after each answer; a worker keeps up to 512 MiB of free heap for its next job)
before the first session, after one and after all N, the ratio of N sessions' growth to one's, and a session
step's median time against the same step run locally with `peft` and AdamW (steps alternate, so load hits both
alike). The adapter after the steps equals local training to float32 rounding (the largest relative difference
is printed).

Run: .venv/bin/python bench/adapters.py [sessions] [--small]
     (--small: the 17M-parameter GPT-2 of tests/integration/test_adapters.py instead of GPT-2 small, 124M)
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import common  # noqa: F401  (puts the repo on sys.path)
import torch

from common import footer, header, start_stack, table
from gradclient import Client

STEPS = 6


def base_model(small: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    off = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: local and remote steps comparable
    config = GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8000, n_positions=128, **off) if small else \
        GPT2Config(n_positions=128, **off)  # GPT-2 small: 12 layers, width 768, 50,257 tokens
    return GPT2LMHeadModel(config)


def lora(base: torch.nn.Module, seed: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                                          lora_dropout=0.0, init_lora_weights="gaussian"))


def rss_mib(pid: int) -> float:
    time.sleep(0.5)
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def main(argv: list[str]) -> None:
    small = "--small" in argv
    n = int(next((a for a in argv if a.isdigit()), "8"))
    started = header("adapters", f"{n} LoRA sessions (rank 8, c_attn) on one {'17M' if small else '124M'} GPT-2 base, "
                     "one CPU worker")
    base = base_model(small)
    vocab = base.config.vocab_size
    models = [lora(base, i) for i in range(n)]
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": (ids := torch.randint(0, vocab, (4, 128), generator=g)), "labels": ids}
    stack = start_stack(1, GRADSVC_TENSOR_BUDGET_BYTES=str(8 << 30))
    try:
        pid = stack.workers[0].pid
        with Client(stack.base_url, timeout=900) as client:
            before = rss_mib(pid)
            sessions = [client.session(models[0], "adamw", lr=1e-3)]
            sessions[0].step(batch, loss="output")
            one = rss_mib(pid)
            for model in models[1:]:
                sessions.append(client.session(model, "adamw", lr=1e-3))
                sessions[-1].step(batch, loss="output")
            every = rss_mib(pid)
            local = copy.deepcopy(models[0])
            opt = torch.optim.AdamW([p for p in local.parameters() if p.requires_grad], lr=1e-3)
            local(**batch).loss.backward()  # the session's first step, taken above
            opt.step()
            opt.zero_grad()
            remote_s, local_s = [], []
            for _ in range(STEPS):
                t = time.perf_counter()
                sessions[0].step(batch, loss="output")
                remote_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                local(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
                local_s.append(time.perf_counter() - t)
            got = sessions[0].state_dict()
            rel = max(float((got[k] - p.detach()).abs().max() / p.detach().abs().max())
                      for k, p in local.named_parameters() if "lora_" in k)
            for s in sessions:
                s.delete()
    finally:
        stack.stop()
    grown_one, grown_all = one - before, every - before
    table(["", "MiB"], [["worker before", f"{before:.0f}"], ["after 1 session", f"{one:.0f}"],
                        [f"after {n} sessions", f"{every:.0f}"],
                        [f"{n} sessions' growth / one's", f"{grown_all / grown_one:.2f}x"]])
    r, lo = statistics.median(remote_s), statistics.median(local_s)
    table(["step", "median s"], [["session", f"{r:.3f}"], ["local peft", f"{lo:.3f}"], ["ratio", f"{r / lo:.2f}x"]])
    print(f"adapter after {STEPS + 1} steps: largest relative difference from local {rel:.1e}")
    footer(started)


if __name__ == "__main__":
    main(sys.argv[1:])
