"""nn.Module -> an exported graph as wire data (GraphSpec) plus its weights; torch is needed only here.

`torch.export.export` captures the module in its current train/eval mode, default export IR (not
`run_decompositions`, which breaks GPT-2-style views), with a dynamic batch dimension (dim 0 of every
input) so that one export serves every batch size. When the dynamic export fails (a model that
specialises on its batch size), a static export is tried and `ExportedGraph.dynamic_batch` is False:
that graph then takes only the example's batch size. A model returning several tensors (a tuple, a
Hugging Face ModelOutput) lists them all in `outputs`; the loss applies to the first.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from gradsvc import wire

from .errors import BadTensorError, UnsupportedModuleError
from .functions import Capture
from .graph import convert_program, reason
from .graph import state_dict_path as _state_dict_path  # noqa: F401  (tests/client/test_export.py reads it here)
from .tensors import several_inputs


@dataclass
class ExportedGraph:
    graph: wire.GraphSpec
    weights: dict[str, torch.Tensor]  # every parameter and buffer the graph reads, by state_dict name
    dynamic_batch: bool = True  # False: the static fallback, valid for the example's batch size only
    frozen: list[str] = field(default_factory=list)  # parameters with requires_grad=False (options.freeze)


def example_inputs(inputs) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """The SDK's `inputs` as export's (args, kwargs): one tensor, a tuple or list of tensors (positional
    arguments) or a mapping of named tensors (keyword arguments, a Hugging Face batch)."""
    if not several_inputs(inputs):
        return (_example(inputs, "inputs"),), {}
    if isinstance(inputs, Mapping):
        kwargs = {k: _example(v, f"inputs[{k!r}]") for k, v in inputs.items()}
        if not kwargs:
            raise BadTensorError("inputs: an empty mapping; give the model's inputs by name")
        return (), kwargs
    return tuple(_example(v, f"inputs[{i}]") for i, v in enumerate(inputs)), {}


def _example(v, where: str) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, (bool, str, bytes, type(None), dict)):
        raise BadTensorError(f"{where}: cannot send a {type(v).__name__} to an exported module; each input is a "
                             "tensor (a torch tensor, a numpy array or a nested list of numbers). Fix non-tensor "
                             "arguments in the module (a wrapper's forward) before sending it")
    try:
        return torch.as_tensor(v)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise BadTensorError(f"{where}: cannot make a tensor of this {type(v).__name__} ({exc}); give a torch "
                             "tensor, a numpy array or a nested list of numbers") from None


def batched_inputs(xs: list[torch.Tensor]) -> list[bool]:
    """Which inputs carry the batch along dim 0: those whose dim 0 is the first input's (the batch size).
    The others (a graph's edge_index (2, edges), a mask shared by every example) go whole to every part
    of a split batch."""
    rows = next((x.shape[0] for x in xs if x.dim() >= 1), None)
    return [x.dim() >= 1 and x.shape[0] == rows for x in xs]


def export_graph(module: nn.Module, example_args: tuple[torch.Tensor, ...] | torch.Tensor,
                 example_kwargs: dict[str, torch.Tensor] | None = None) -> ExportedGraph:
    """`module` captured by torch.export and converted to the wire format; UnsupportedModuleError (with
    torch's reason) when it cannot be. `example_args` are forward's positional inputs, `example_kwargs`
    its keyword inputs (the request then names them)."""
    if not isinstance(module, nn.Module):
        raise UnsupportedModuleError(f"expected an nn.Module, got {type(module).__name__}")
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    args, kwargs = tuple(example_args), dict(example_kwargs or {})
    xs = [*args, *kwargs.values()]
    if not xs or not all(isinstance(x, torch.Tensor) for x in xs) or xs[0].dim() < 1:
        raise UnsupportedModuleError("example inputs must be tensors, the first with a batch dimension (dim 0)")
    batched = batched_inputs(xs)
    dynamic = True
    # A batch of one would be specialised to the constant 1; the trace sees only shapes, so a batch of
    # one is traced as two (the example repeated) and the graph still takes any batch size.
    twice = xs[0].shape[0] == 1

    def traced(x, b):
        return torch.cat([x, x]) if b and twice else x

    t_args = tuple(traced(x, b) for x, b in zip(args, batched))
    t_kwargs = {k: traced(x, b) for (k, x), b in zip(kwargs.items(), batched[len(args):])}
    batch = torch.export.Dim("batch", min=1)
    dims = [{0: batch} if b else None for b in batched]
    shapes = dict(zip(kwargs, dims[len(args):])) if kwargs else tuple(dims)
    capture = Capture()
    with warnings.catch_warnings():
        # nn.GRU/LSTM/RNN re-set their `_flat_weights` list in forward; export warns, yet lifts each weight
        # as the parameter it is.
        warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights")
        try:
            with capture.active():
                ep = torch.export.export(module, t_args, kwargs=t_kwargs or None, dynamic_shapes=shapes)
        except UnsupportedModuleError:
            raise
        except Exception:
            dynamic = False
            try:
                with capture.active():
                    ep = torch.export.export(module, args, kwargs=kwargs or None)
            except UnsupportedModuleError:
                raise
            except Exception as exc:
                raise UnsupportedModuleError(f"torch.export cannot capture {type(module).__name__}: "
                                             f"{reason(exc)}") from None
    graph, weights = convert_program(ep, module, batched)
    if capture.calls:
        used = {n.op.removeprefix("function.") for n in graph.nodes if n.op.startswith("function.")}
        graph.functions = {k: f for k, f in capture.functions().items() if k in used}
    params = dict(module.named_parameters(remove_duplicate=False))
    frozen = [i.target for i in graph.inputs if i.kind == "parameter" and not params[i.target].requires_grad]
    return ExportedGraph(graph=graph, weights=weights, dynamic_batch=dynamic, frozen=frozen)
