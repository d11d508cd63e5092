"""What judging the returned gradients costs: numcheck.returned_check (every element of every returned
tensor against the float64 reference, plus 16 directions) against the float64 forward + backward that
computes the reference, which the numerical check runs anyway.

An MLP 32 -> H -> 10 (tanh), batch 16, cross-entropy; the returned gradients are float32 (what a float32
request returns). "x ref" divides the check's median time by the reference's. The check reads each
tensor once and allocates one float64 copy of it: its cost grows with P alone, never with the batch.

Run: .venv/bin/python bench/returned_check.py
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo on sys.path)
import torch
from torch import nn

from common import footer, header, median, table, timed
from workers.engine import numcheck

HIDDEN = [24, 2400, 24000]  # P = 43H + 10: 1042, 103210, 1032010
DIRECTIONS = 16


def main() -> list[list]:
    started = header("The returned-gradient check vs the reference gradient it compares with", __doc__.split("Run:")[0])
    rows = []
    for h in HIDDEN:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, h), nn.Tanh(), nn.Linear(h, 10)).double()
        x, y = torch.randn(16, 32, dtype=torch.float64), torch.randint(0, 10, (16,))
        params = dict(model.named_parameters())

        def reference():
            return dict(zip(params, torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(params.values()))))

        ref = reference()
        returned = {n: g.float() for n, g in ref.items()}
        scale = 1.0 / sum(p.numel() for p in params.values()) ** 0.5
        us = [{n: torch.randint(0, 2, p.shape, dtype=torch.float64).mul_(2).sub_(1).mul_(scale) for n, p in params.items()}
              for _ in range(DIRECTIONS)]

        def check():
            along = [(sum(float((returned[n].double() * u[n]).sum()) for n in params),
                      sum(float((ref[n] * u[n]).sum()) for n in params),
                      sum(float((ref[n] * u[n]).abs().sum()) for n in params)) for u in us]
            return numcheck.returned_check(returned, ref, torch.float32, along)

        ref_ms = 1e3 * median(timed(reference, 5))
        elementwise_ms = 1e3 * median(timed(lambda: numcheck.returned_check(returned, ref, torch.float32), 5))
        check_ms = 1e3 * median(timed(check, 5))
        assert check().passed
        p = 43 * h + 10
        rows.append([p, ref_ms, elementwise_ms, elementwise_ms / ref_ms, check_ms, check_ms / ref_ms])
    table(["P", "reference f+b ms", "element-wise ms", "x ref", f"+ {DIRECTIONS} directions ms", "x ref"], rows)
    footer(started)
    return rows


if __name__ == "__main__":
    main()
