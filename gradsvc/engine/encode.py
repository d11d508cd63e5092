"""The wire result: every tensor encoded, a frozen parameter's gradient null, and the cosines between
per-loss gradients."""

from __future__ import annotations

import torch

from gradsvc.wire import GradientRequest, GradientResult, Timings

from . import outputs, tensors
from .passes import Pass
from .prepared import Prepared, batch_chunks


def encode_result(request: GradientRequest, prep: Prepared, device: torch.device, final: Pass, *, per_sample,
                  hvp: bool, check, memory, checkpoint, timings: Timings) -> GradientResult:
    """The wire result: every tensor encoded, a frozen parameter's gradient null."""
    opts = prep.options
    several = len(prep.terms) > 1
    gradients = {n: (tensors.encode(final.grads[n]) if n in final.grads else None)
                 for n, _ in prep.model.named_parameters()}
    return GradientResult(
        device=str(device),
        dtype=request.model.dtype,
        parameter_count=prep.parameter_count,
        torch_version=str(torch.__version__),
        loss=final.loss,
        gradients=gradients,
        micro_batches=len(batch_chunks(prep.inputs.rows, opts.micro_batch)),
        losses=dict(final.losses) if several else None,
        per_loss_gradients=({t: {n: (tensors.encode(g[n]) if n in g else None) for n in gradients}
                             for t, g in final.per_loss.items()} if final.per_loss else None),
        gradient_cosine=cosines(final.per_loss) if final.per_loss else None,
        per_sample=per_sample,
        input_gradient=tensors.encode(torch.cat(final.input_grad)) if opts.input_grad else None,
        hvp={n: (tensors.encode(final.hvp[n]) if n in final.hvp else None) for n in gradients} if hvp else None,
        graph=final.graph,
        numcheck=check,
        memory=memory,
        checkpoint=checkpoint,
        timings=timings,
        graph_ref=prep.graph.ref if prep.graph is not None else None,
        seed=request.model.seed,
        buffers={n: tensors.encode(b) for n, b in final.buffers.items()} if final.buffers else None,
        outputs=_outputs(prep, final),
    )


def _outputs(prep: Prepared, final: Pass):
    """options.outputs: forward's outputs in the structure it returns them (graph models)."""
    if final.outputs is None or prep.graph is None:
        return None
    return outputs.as_returned(outputs.tree_of(prep.graph.spec), final.outputs, prep.graph.first_output)


def cosines(per_loss: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """The cosine between every pair of per-loss gradients ("a|b"): negative when the tasks pull apart."""
    flat = {k: torch.cat([g.reshape(-1).to(torch.float64) for g in v.values()]) for k, v in per_loss.items()}
    names = list(flat)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            denom = float(flat[a].norm() * flat[b].norm())
            out[f"{a}|{b}"] = float(flat[a] @ flat[b]) / denom if denom > 0 else 0.0
    return out
