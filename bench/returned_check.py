"""What judging the returned gradients costs: a directional numerical check (16 directions, 32 float64
loss evaluations) with and without the returned-gradient check (every element of every returned tensor
against the float64 reference, and the returned gradient along the same 16 directions).

An MLP 32 -> H -> 10 (tanh), batch 16, cross-entropy, float64 parameters; the returned gradients are
float32 (what a float32 request returns). "ratio" divides the check with the returned comparison by
the check without it. The comparison reads each tensor a few times and keeps one float64 copy of the
returned gradients: O(P) work, against 32 float64 forwards that are each O(P x batch).

Run: .venv/bin/python bench/returned_check.py
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo on sys.path)
import torch
from torch import nn

from common import footer, header, median, table, timed
from gradsvc.engine.numcheck.run import CheckRun, run

HIDDEN = [24, 2400, 24000]  # P = 43H + 10: 1042, 103210, 1032010


def main() -> list[list]:
    started = header("Directional numerical check with and without judging the returned gradients",
                     __doc__.split("Run:")[0])
    rows = []
    for h in HIDDEN:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, h), nn.Tanh(), nn.Linear(h, 10)).double()
        x, y = torch.randn(16, 32, dtype=torch.float64), torch.randint(0, 10, (16,))
        params = dict(model.named_parameters())

        def loss_fn():
            return nn.functional.cross_entropy(model(x), y)

        ref = dict(zip(params, torch.autograd.grad(loss_fn(), list(params.values()))))
        returned = {n: g.float() for n, g in ref.items()}
        kw = dict(eps=1e-6, tolerance=1e-6, samples=8, directions=16, seed=0)
        without = 1e3 * median(timed(lambda: run(CheckRun("directional", params, loss_fn, ref, **kw)), 5))
        with_ = 1e3 * median(timed(lambda: run(CheckRun("directional", params, loss_fn, ref, returned=returned,
                                                        returned_dtype=torch.float32, **kw)), 5))
        check = run(CheckRun("directional", params, loss_fn, ref, returned=returned, returned_dtype=torch.float32, **kw))
        assert check.passed and check.returned_max_rel_error < 1e-4
        rows.append([43 * h + 10, without, with_, with_ / without, check.returned_max_rel_error])
    table(["P", "directional ms", "+ returned check ms", "ratio", "returned_max_rel_error"], rows)
    footer(started)
    return rows


if __name__ == "__main__":
    main()
