"""A plain training loop, every step's gradients computed by the service.

The MLP 784 -> 128 (ReLU) -> 10 with CrossEntropy and SGD, on synthetic 28x28 "digits" (labels from a
fixed random teacher, so there is something to learn). A local copy trains beside it with
loss.backward(). At the end the two agree to float32 rounding: bit for bit when the worker runs torch on
as many threads as this process (one `gradsvc up` worker), within about 1e-8 otherwise (with two workers
each uses half the cores, and a float32 matmul sums in an order that follows the thread count). The
script prints the largest weight difference and checks it is below WEIGHT_TOLERANCE (1e-6).

    .venv/bin/python examples/train_mlp.py --base-url http://127.0.0.1:8000 --epochs 3
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from gradclient import Client


WEIGHT_TOLERANCE = 1e-6  # float32 rounding over a few dozen SGD steps, whatever the thread counts


def synthetic_digits(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 1, 28, 28, generator=g)  # (n, 1, 28, 28)
    teacher = torch.randn(784, 10, generator=g)
    labels = (images.flatten(1) @ teacher).argmax(1)  # (n,)
    return images, labels


def main(base_url: str | None = None, epochs: int = 3, samples: int = 256, batch_size: int = 64, lr: float = 0.1,
         seed: int = 0, verbose: bool = True) -> dict:
    torch.manual_seed(seed)
    # SimpleNet's fc1 -> relu -> fc2, with nn.Flatten for its x.view(-1, 784): a forward the spec can say.
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    local = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    local_optimizer = torch.optim.SGD(local.parameters(), lr=lr)
    images, labels = synthetic_digits(samples, seed)
    losses = []
    with Client(base_url) as client:
        for epoch in range(1, epochs + 1):
            for start in range(0, samples, batch_size):
                x, y = images[start:start + batch_size], labels[start:start + batch_size]
                optimizer.zero_grad()
                result = client.gradients(model, x, y, loss="cross_entropy", numcheck="off", memory=False)
                result.set_grads(model)  # what loss.backward() would have left in .grad
                optimizer.step()
                losses.append(result.loss)

                local_optimizer.zero_grad()
                F.cross_entropy(local(x), y).backward()
                local_optimizer.step()
            if verbose:
                print(f"epoch {epoch}: loss {sum(losses[-(samples // batch_size):]) / (samples // batch_size):.4f}")
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), local.parameters()))
    if verbose:
        print(f"{len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
              f"largest weight difference from local training: {diff:.2e} "
              f"({'within' if diff <= WEIGHT_TOLERANCE else 'ABOVE'} {WEIGHT_TOLERANCE:g})")
    return {"losses": losses, "max_weight_diff": diff}


if __name__ == "__main__":
    import _cli

    _cli.run(main, __doc__, epochs=("--epochs", 3, "passes over the samples (default 3)"),
             samples=("--samples", 256, "synthetic digits, in batches of 64 (default 256)"))
