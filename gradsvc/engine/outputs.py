"""A graph's outputs beyond the first: which one is the model's own loss (`loss: "output"` or `{"output": k}`),
and forward's outputs and written buffers as the result carries them.

The loss is found in the structure forward returns (the graph's `output_tree`): the first output when it is a
scalar, else a dict's or ModelOutput's `loss`, else the one 0-d floating output of a tuple or list. The engine
then runs a copy of the graph whose outputs start with that one, so that everything reading "the first output"
(the meta shape check, the batch flow, the numerical check) reads the loss.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsvc.wire import GraphSpec

from . import tensors
from .errors import SpecError
from .graph.program import Ref


def tree_of(spec: GraphSpec) -> Any:
    """The graph's output structure; a flat tuple of its outputs where the graph does not say."""
    return spec.output_tree if spec.output_tree is not None else list(range(len(spec.outputs)))


def leaves(tree: Any, path: str = "") -> list[tuple[str, int]]:
    """(path, output index) of every tensor in `tree`, in order: "[1]", "['loss']", "[0][1]"."""
    if isinstance(tree, bool) or tree is None:
        return []
    if isinstance(tree, int):
        return [(path or "[0]", tree)]
    if isinstance(tree, list):
        return [leaf for i, sub in enumerate(tree) for leaf in leaves(sub, f"{path}[{i}]")]
    if isinstance(tree, dict):
        return [leaf for k, sub in tree.items() for leaf in leaves(sub, f"{path}[{k!r}]")]
    return []


def named_output(tree: Any, name: int | str) -> int:
    """The output index `{"output": name}` names: a position of the tuple forward returns, or a key of its dict."""
    if isinstance(name, bool):
        name = str(name)
    top = tree if isinstance(tree, (list, dict)) else [tree]
    if isinstance(top, list) and isinstance(name, int) and -len(top) <= name < len(top):
        sub = top[name]
    elif isinstance(top, dict) and isinstance(name, str) and name in top:
        sub = top[name]
    else:
        what = (f"positions 0..{len(top) - 1}" if isinstance(top, list) else f"keys {list(top)}")
        raise SpecError("bad_loss", f"loss {{'output': {name!r}}}: forward's outputs have no such entry; they have "
                        f"{what}", output=name, outputs=[p for p, _ in leaves(tree)])
    if not isinstance(sub, int) or isinstance(sub, bool):
        raise SpecError("bad_loss", f"loss {{'output': {name!r}}} is not one tensor (it holds {len(leaves(sub))}); "
                        "name the scalar loss itself", output=name)
    return sub


def pick_loss(tree: Any, shapes: list[tuple[list[int], torch.dtype]], name: int | str | None) -> int:
    """The index of the output the model's own loss differentiates, from the outputs' meta shapes and dtypes."""
    if name is not None:
        k = named_output(tree, name)
        _check_scalar(k, shapes, f"loss {{'output': {name!r}}}")
        return k
    if shapes and _is_scalar(shapes[0]):
        return 0
    if isinstance(tree, dict) and isinstance(tree.get("loss"), int) and not isinstance(tree["loss"], bool):
        _check_scalar(tree["loss"], shapes, "the output 'loss'")
        return tree["loss"]
    found = [(p, k) for p, k in leaves(tree) if k < len(shapes) and _is_scalar(shapes[k], zero_d=True)]
    if len(found) == 1:
        return found[0][1]
    paths = [p for p, _ in found]
    if found:
        raise SpecError("bad_loss", f"loss 'output': forward returns {len(found)} scalars ({', '.join(paths)}), so "
                        "which one is the loss is ambiguous; name it: loss={'output': 1} for the second entry of "
                        "the tuple forward returns, or {'output': 'loss'} for a dict's key", candidates=paths)
    got = [f"{p}: {list(shapes[k][0])}" for p, k in leaves(tree) if k < len(shapes)][:8]
    raise SpecError("bad_loss", "loss 'output' differentiates a scalar the model returns (its first output, a dict's "
                    "'loss', or a tuple's only 0-d floating tensor), but forward returns none: "
                    f"{'; '.join(got)}. Return the loss (a Hugging Face model does when given labels=), or use a "
                    "built-in loss on the logits", output_shape=list(shapes[0][0]) if shapes else [],
                    outputs=got)


def _is_scalar(entry: tuple[list[int], torch.dtype], zero_d: bool = False) -> bool:
    shape, dtype = entry
    n = 1
    for s in shape:
        n *= s
    return dtype.is_floating_point and (len(shape) == 0 if zero_d else n == 1)


def _check_scalar(k: int, shapes: list, what: str) -> None:
    if k >= len(shapes) or not _is_scalar(shapes[k]):
        shape = list(shapes[k][0]) if k < len(shapes) else None
        raise SpecError("bad_loss", f"{what} is not a floating scalar (shape {shape}); name the loss forward "
                        "returns, or use a built-in loss", output_shape=shape)


def loss_first(spec: GraphSpec, k: int) -> GraphSpec:
    """The graph with output k moved to the front (what the loss differentiates), the others after in order."""
    import msgspec

    order = [k, *[i for i in range(len(spec.outputs)) if i != k]]
    return msgspec.structs.replace(spec, outputs=[spec.outputs[i] for i in order])


def as_returned(tree: Any, values: list, first: int) -> Any:
    """forward's outputs in the structure it returns them, each tensor encoded; `values` are the run's outputs,
    output `first` moved to the front (loss_first)."""
    order = [first, *[i for i in range(len(values)) if i != first]]
    by_index = {i: values[pos] for pos, i in enumerate(order)}

    def build(sub: Any) -> Any:
        if isinstance(sub, bool) or sub is None:
            return None
        if isinstance(sub, int):
            v = by_index.get(sub)
            return tensors.encode(v) if isinstance(v, torch.Tensor) else None
        if isinstance(sub, list):
            return [build(s) for s in sub]
        if isinstance(sub, dict):
            return {k: build(s) for k, s in sub.items()}
        return None

    return build(tree)


def written_buffers(compiled: Any) -> list[str]:
    """The state_dict names of the buffers a run of the compiled graph may write: those an in-place op writes
    (a counter's add_, an EMA's mul_ and add_, chained or not), the running statistics a normalisation in
    training mode updates, and the graph's buffer_mutations."""
    from .graph.batch_flow import _arg
    from .graph.compiler import _STAT_WRITES

    buffer_of = {slot: inp.target for slot, inp in compiled.inputs if inp.kind == "buffer"}
    written = {target for target, _ in compiled.mutations}
    for step in compiled.steps:
        refs = [a for a in step.args if isinstance(a, Ref)] + [v for v in step.kwargs.values() if isinstance(v, Ref)]
        if step.writes_buffer and refs and refs[0].i in buffer_of:
            written.add(buffer_of[refs[0].i])
            buffer_of[step.slot] = buffer_of[refs[0].i]  # the in-place op's result is the buffer itself
        elif step.op.name in _STAT_WRITES:
            flag = "use_input_stats" if step.op.name == "aten.instance_norm.default" else "training"
            if _arg(step, flag) is not False:
                written.update(buffer_of[r.i] for r in refs if r.i in buffer_of)
    order = [inp.target for _, inp in compiled.inputs if inp.kind == "buffer"]
    return [t for t in order if t in written]
