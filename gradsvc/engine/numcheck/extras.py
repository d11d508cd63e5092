"""The returned quantities besides the gradients, each checked its own way against the float64 reference
(gradsvc/engine/quantities.py): the per-loss gradients, the per-example gradients' sum, H v, the input
gradient."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import quantities
from .reference import Reference, computed_dtype
from .tolerances import returned_tolerance

if TYPE_CHECKING:
    from ..passes import Pass


def quantity_checks(ref: Reference, final: Pass, hvp_vector: dict[str, torch.Tensor] | None,
                    per_sample_sum: dict[str, torch.Tensor] | None) -> dict:
    """Each quantity `final` returned besides the gradients, checked against `ref`."""
    prep, params, opts = ref.prep, ref.params, ref.prep.options
    exact = returned_tolerance(computed_dtype(prep), ref.math_mode)  # identities: the returned dtype's tolerance
    by_differences = max(exact, opts.numcheck_tolerance)  # differences in float64 resolve no better than this
    out = {}
    returned = {n: g for n, g in final.grads.items() if n in params}
    if final.per_loss:
        losses = ref.term_losses()
        reference = {}
        for k, (term, value) in enumerate(zip(prep.terms, losses)):
            grads = torch.autograd.grad(value, list(params.values()), retain_graph=k < len(losses) - 1,
                                        materialize_grads=True)
            reference[term.name] = dict(zip(params, grads))
        out["per_loss"] = quantities.per_loss({t: {n: g[n] for n in returned} for t, g in final.per_loss.items()},
                                              reference, exact)
    if per_sample_sum is not None and returned and len({t.reduction for t in prep.terms}) == 1:
        how = ("the per-example gradients " + ("averaged" if prep.terms[0].reduction == "mean" else "summed") +
               ", against the returned gradients")
        out["per_sample"] = quantities.per_sample({n: per_sample_sum[n] for n in returned}, returned, exact, how)
    if hvp_vector is not None and final.hvp:
        out["hvp"] = quantities.hvp(params, ref.loss_fn, hvp_vector, final.hvp, opts.numcheck_eps, by_differences)
    if opts.input_grad and final.input_grad:
        i = ref.x64.floating()[0]

        def loss_at(x: torch.Tensor) -> torch.Tensor:
            xs = list(ref.x64.tensors)
            xs[i] = x
            return ref.loss_fn(tuple(xs))

        out["input_gradient"] = quantities.input_gradient(loss_at, ref.x64.tensors[i], torch.cat(final.input_grad),
                                                          opts.numcheck_eps, by_differences, ref.seed)
    return out
