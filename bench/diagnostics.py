"""Gradient diagnostics through the service against the libraries a user would run locally, on the same
models, measured in the same run.

  top eigenvalue   a 46k-parameter CNN (Conv-ReLU-MaxPool x 2, Linear), batch 64 of 3x32x32, float32, cross
                   entropy, tolerance 1e-3: the service's options.curvature {top: 1} end to end through the SDK
                   (client wall time) against PyHessian's hessian(...).eigenvalues(top_n=1, tol=1e-3) run
                   locally; both eigenvalues are printed (the accuracy is the same when they agree to 1e-3).
  trace per probe  the service's Hutchinson cost per probe (worker's total_ms at 40 probes minus at 10, / 30)
                   against one local forward-over-reverse H v (torch.func.jvp of torch.func.grad).
  variance         diagnostics ["variance", "second_moment"]: the worker's total_ms for the job against
                   BackPACK's forward + backward with Variance() and SumGradSquared() locally.
A private stack (tests/support/stack.py), one worker; numcheck and memory off in every request. Each row is
the median of ROUNDS; the goals: at most 0.5, 1.5 and 2.0.

Run: .venv/bin/python bench/diagnostics.py
"""

from __future__ import annotations

import copy
import time

import common  # noqa: F401  (puts the repo on sys.path)
import torch
from torch import nn

from common import footer, header, median, start_stack, table, timed, verdict

ROUNDS = 3
OFF = {"numcheck": "off", "memory": False}


def cnn() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(32 * 8 * 8, 20))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 20, (64,), generator=g)


def pyhessian_top(model, x, y) -> tuple[float, float]:
    from pyhessian import hessian

    model = copy.deepcopy(model)
    t0 = time.perf_counter()
    values, _ = hessian(model, nn.CrossEntropyLoss(), data=(x, y), cuda=False).eigenvalues(maxIter=100, tol=1e-3,
                                                                                              top_n=1)
    return time.perf_counter() - t0, float(values[0])


def service_top(client, model, x, y) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    r = client.gradients(model, x, y, **OFF, curvature={"top": 1, "tolerance": 1e-3})
    return time.perf_counter() - t0, r.curvature.top_eigenvalues[0], r.curvature.residuals[0]


def local_hvp_s(model, x, y) -> float:
    from torch.func import functional_call, grad, jvp

    params = {n: p.detach() for n, p in model.named_parameters()}
    v = {n: torch.randn_like(p) for n, p in params.items()}
    loss = lambda ps: nn.functional.cross_entropy(functional_call(model, ps, (x,)), y)  # noqa: E731
    return median(timed(lambda: jvp(grad(loss), (params,), (v,)), repeat=10, warmup=2))


def service_probe_s(client, model, x, y) -> float:
    def total_ms(probes: int) -> float:
        return client.gradients(model, x, y, **OFF, curvature={"top": 0, "trace": True,
                                                               "probes": probes}).timings.total_ms
    return (total_ms(40) - total_ms(10)) / 30 / 1e3


def backpack_s(model, x, y) -> float:
    from backpack import backpack, extend
    from backpack.extensions import SumGradSquared, Variance

    local, loss = extend(copy.deepcopy(model)), extend(nn.CrossEntropyLoss())

    def run():
        local.zero_grad()
        with backpack(Variance(), SumGradSquared()):
            loss(local(x), y).backward()
    return median(timed(run, repeat=5, warmup=1))


def service_variance_s(client, model, x, y) -> float:
    r = client.gradients(model, x, y, **OFF, diagnostics=["variance", "second_moment"])
    return r.timings.total_ms / 1e3


def main() -> list[list]:
    started = header("Gradient diagnostics: the service against PyHessian, BackPACK and a local HVP",
                     __doc__.split("Run:")[0])
    model, x, y = cnn()
    print(f"parameters: {sum(p.numel() for p in model.parameters())}")
    stack = start_stack(workers=1)
    rows = []
    try:
        with stack.sdk_client(timeout=600) as client:
            service_top(client, model, x, y)  # warms the worker (the spec's first job builds its model)
            top = [(pyhessian_top(model, x, y), service_top(client, model, x, y)) for _ in range(ROUNDS)]
            (_, ph_value), (_, sv_value, residual) = top[-1][0], top[-1][1]
            ratio = median(s[0] / p[0] for p, s in top)
            rows.append(["top eigenvalue (s)", median(s[0] for _, s in top), median(p[0] for p, _ in top), ratio,
                         verdict(ratio, 0.5)])
            print(f"top eigenvalue: service {sv_value:.6g} (residual {residual:.2g}), PyHessian {ph_value:.6g}")
            probe = [(service_probe_s(client, model, x, y), local_hvp_s(model, x, y)) for _ in range(ROUNDS)]
            ratio = median(s / h for s, h in probe)
            rows.append(["trace, per probe (s)", median(s for s, _ in probe), median(h for _, h in probe), ratio,
                         verdict(ratio, 1.5)])
            var = [(service_variance_s(client, model, x, y), backpack_s(model, x, y)) for _ in range(ROUNDS)]
            ratio = median(s / b for s, b in var)
            rows.append(["variance + second moment (s)", median(s for s, _ in var), median(b for _, b in var),
                         ratio, verdict(ratio, 2.0)])
    finally:
        stack.stop()
    table(["quantity", "service", "local library", "ratio", "goal"], rows)
    footer(started)
    return rows


if __name__ == "__main__":
    main()
