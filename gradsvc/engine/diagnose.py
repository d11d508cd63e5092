"""What went wrong in a pass, named where it happened: the first layer or graph node whose output is not
finite (a second, diagnostic forward), or the graph node that failed on this batch's values."""

from __future__ import annotations

import torch

from . import tensors
from .errors import ComputeError, SpecError
from .prepared import Prepared
from .spec import leaves


def non_finite_error(prep: Prepared, value: float) -> ComputeError:
    """Names the first layer whose output is not finite (a second, diagnostic forward)."""
    first = None
    handles = []

    def hook(name):
        def fn(module, args, out):
            nonlocal first
            if first is None and isinstance(out, torch.Tensor) and not tensors.all_finite(out):
                first = (name, type(module).__name__)
        return fn

    if prep.graph is not None:
        first = _first_non_finite_node(prep)
    else:
        for name, module in leaves(prep.model):
            handles.append(module.register_forward_hook(hook(name)))
        try:
            with torch.no_grad():
                prep.model(*prep.inputs.tensors)
        finally:
            for h in handles:
                h.remove()
    where = f"layer {first[0]} ({first[1]})" if first else "the loss"
    return ComputeError("non_finite", f"the loss is {value}; the first non-finite values appear in the output of "
                        f"{where}. Check the inputs' scale, the weights and the learning setup",
                        layer=first[0] if first else None, value=str(value))


def _first_non_finite_node(prep: Prepared) -> tuple[str, str] | None:
    """(module path, "node (op)") of the first graph node whose output is not finite."""
    model = prep.model
    first = None

    def visit(i, out, args, kwargs):
        nonlocal first
        if first is None and isinstance(out, torch.Tensor) and out.is_floating_point() and \
                not tensors.all_finite(out):
            name, path, _ = model.node_modules[i]
            first = (path or "(root)", f"node {name}")
    with torch.no_grad():
        model.run(*prep.inputs.tensors, visit=visit)
    return first


def graph_failure(prep: Prepared, exc: Exception) -> SpecError:
    """A graph node that failed on this batch's values (shapes were checked before the queue): an
    index out of range, most often token ids beyond an embedding's rows."""
    i = getattr(prep.model, "failed_node", None)
    name, path, kind = prep.model.node_modules[i] if i is not None and i >= 0 else ("?", "", "")
    where = f"node {name!r} in module {path!r} ({kind})" if path else f"node {name!r}"
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return SpecError("bad_tensor", f"the graph's {where} failed on these inputs: {reason}. Check the inputs' values "
                     "(token ids must lie below the embedding's number of rows)", node=name, module=path)
