"""What the recorded capture costs the SDK (gradclient/trace.py): recording a forward the three export attempts
could not capture, and checking its guards on the next batch (the replay of the program up to its last read),
each against one eager forward of the same module and batch. Medians of 7 rounds, one torch thread.

Run: .venv/bin/python bench/capture.py
"""

from __future__ import annotations

import time

import common  # noqa: F401  (puts the repo on sys.path)
import torch
from torch import nn

from gradclient.export import export_graph
from gradclient.replay import check_guards
from gradclient.trace import trace_graph


class PolicyLoss(nn.Module):
    """A policy-gradient loss with validating distributions and an `if` on a value: export cannot capture it."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.logits = nn.Linear(width, 8)

    def forward(self, obs: torch.Tensor, act: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        pi = torch.distributions.Categorical(logits=self.logits(self.body(obs)), validate_args=True)
        loss = -(pi.log_prob(act) * adv).mean()
        if pi.entropy().mean() > 0.5:
            loss = loss - 0.01 * pi.entropy().mean()
        return loss


def best(fn, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = PolicyLoss()
    args = (torch.randn(64, 32), torch.randint(0, 8, (64,)), torch.randn(64))
    traced = trace_graph(model, args, {}, [True, True, True])
    rounds = {"forward": [], "record": [], "guards": [], "export+record": []}
    for _ in range(7):
        rounds["forward"].append(best(lambda: model(*args)))
        rounds["record"].append(best(lambda: trace_graph(model, args, {}, [True, True, True])))
        rounds["guards"].append(best(lambda: check_guards(traced, model, list(args))))
    rounds["export+record"].append(best(lambda: export_graph(model, args), n=1))
    med = {k: sorted(v)[len(v) // 2] for k, v in rounds.items()}
    print(f"{'':24}{'ms':>10}{'x forward':>12}")
    for k, v in med.items():
        print(f"{k:24}{v * 1e3:10.2f}{v / med['forward']:12.1f}")


if __name__ == "__main__":
    main()
