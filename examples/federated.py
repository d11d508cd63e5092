"""Federated-style averaging: several clients each compute gradients on their own shard with the
service (concurrently, AsyncClient), the server averages them and takes one SGD step per round.

With equal shards and mean losses, the average of the shard gradients is the full-batch gradient; the
script checks that against local autograd in the first round.

    python examples/federated.py --base-url http://127.0.0.1:8000 --clients 4 --rounds 5
"""

from __future__ import annotations

import asyncio

import torch
import torch.nn.functional as F
from torch import nn

from gradclient import AsyncClient


def shards(n_clients: int, per_client: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_clients * per_client, 20, generator=g)  # (n, 20)
    y = (x[:, :5].sum(1) > 0).long() + (x[:, 5:10].sum(1) > 0).long()  # (n,) three classes
    return [(x[i::n_clients], y[i::n_clients]) for i in range(n_clients)]


async def run(base_url: str | None, n_clients: int, rounds: int, per_client: int, lr: float, seed: int,
              verbose: bool) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 3))
    data = shards(n_clients, per_client, seed)
    clients = [AsyncClient(base_url) for _ in range(n_clients)]  # one participant each
    losses, first_round_diff = [], None
    try:
        for r in range(rounds):
            results = await asyncio.gather(*(c.gradients(model, x, y, numcheck="off", memory=False)
                                             for c, (x, y) in zip(clients, data)))
            average = {name: torch.stack([res.gradients[name] for res in results]).mean(0)
                       for name in results[0].gradients}
            losses.append(sum(res.loss for res in results) / n_clients)
            if r == 0:
                x_all, y_all = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
                model.zero_grad()
                F.cross_entropy(model(x_all), y_all).backward()
                first_round_diff = max((average[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p -= lr * average[name]
            if verbose:
                print(f"round {r + 1}: mean loss over {n_clients} clients {losses[-1]:.4f}")
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    if verbose:
        print(f"averaged shard gradients vs full-batch autograd (round 1): {first_round_diff:.2e}")
    return {"losses": losses, "first_round_diff": first_round_diff}


def main(base_url: str | None = None, n_clients: int = 4, rounds: int = 5, per_client: int = 64, lr: float = 0.5,
         seed: int = 0, verbose: bool = True) -> dict:
    return asyncio.run(run(base_url, n_clients, rounds, per_client, lr, seed, verbose))


if __name__ == "__main__":
    import _cli

    _cli.run(main, __doc__, n_clients=("--clients", 4, "participants, one shard of 64 examples each (default 4)"),
             rounds=("--rounds", 5, "averaging rounds, one SGD step each (default 5)"))
