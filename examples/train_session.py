"""The same training loop twice, side by side: with a session (the weights and AdamW stay on the worker, each step sends the batch alone) and with local gradients (each step sends the weights to POST /gradients and steps AdamW here).

The MLP 784 -> 128 (ReLU) -> 10 with CrossEntropy and AdamW (clipped at norm 1.0), on synthetic 28x28 "digits"
(labels from a fixed random teacher). Both loops start from the same weights and see the same batches; at the end
the script prints how far apart their weights ended (float32 rounding: below WEIGHT_TOLERANCE) and the bytes each
sent per step.

    .venv/bin/python examples/train_session.py --base-url http://127.0.0.1:8000 --epochs 2
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from gradclient import Client

WEIGHT_TOLERANCE = 1e-5  # float32 rounding over a few dozen AdamW steps (Adam divides by sqrt(v): small v amplify it)


def synthetic_digits(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 1, 28, 28, generator=g)  # (n, 1, 28, 28)
    teacher = torch.randn(784, 10, generator=g)
    return images, (images.flatten(1) @ teacher).argmax(1)  # (n,)


def main(base_url: str | None = None, epochs: int = 2, samples: int = 256, batch_size: int = 64, lr: float = 1e-3,
         seed: int = 0, verbose: bool = True) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    local = copy.deepcopy(model)
    local_optimizer = torch.optim.AdamW(local.parameters(), lr=lr)
    images, labels = synthetic_digits(samples, seed)
    session_losses, local_losses, local_bytes = [], [], 0
    with Client(base_url) as client, client.session(model, optimizer="adamw", lr=lr, clip=1.0) as session:
        for epoch in range(1, epochs + 1):
            for start in range(0, samples, batch_size):
                x, y = images[start:start + batch_size], labels[start:start + batch_size]
                # The session: the batch goes up, the loss comes back.
                session_losses.append(session.step(x, y).loss)
                # Local gradients: the weights go up, the gradients come back, AdamW steps here.
                result = client.gradients(local, x, y, loss="cross_entropy", numcheck="off", memory=False)
                local_optimizer.zero_grad()
                result.set_grads(local)
                torch.nn.utils.clip_grad_norm_(local.parameters(), 1.0)
                local_optimizer.step()
                local_losses.append(result.loss)
                local_bytes += result.upload_bytes
            if verbose:
                print(f"epoch {epoch}: session loss {session_losses[-1]:.4f}, local loss {local_losses[-1]:.4f}")
        session.pull(model)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), local.parameters()))
    batch_bytes = images[:batch_size].numel() * 4 + labels[:batch_size].numel() * 8
    if verbose:
        print(f"{len(session_losses)} steps; largest weight difference between the loops: {diff:.2e} "
              f"({'within' if diff <= WEIGHT_TOLERANCE else 'ABOVE'} {WEIGHT_TOLERANCE:g}); the session sent the "
              f"batch ({batch_bytes} bytes) a step, the local loop {local_bytes // len(local_losses)} bytes a step")
    return {"session_losses": session_losses, "local_losses": local_losses, "max_weight_diff": diff}


if __name__ == "__main__":
    import _cli

    _cli.run(main, __doc__, epochs=("--epochs", 2, "passes over the samples (default 2)"),
             samples=("--samples", 256, "synthetic digits, in batches of 64 (default 256)"))
