"""nn.Module -> an exported graph as wire data (GraphSpec) plus its weights; torch is needed only here.

`torch.export.export` captures the module in its current train/eval mode, default export IR (not
`run_decompositions`, which breaks GPT-2-style views), with a dynamic batch dimension (dim 0 of every
input, dim 1 of an RNN's state) so that one export serves every batch size. When the dynamic export fails
(a model that specialises on its batch size), a static export is tried and `ExportedGraph.dynamic_batch`
is False: that graph then takes only the example's batch size; when that fails (a data-dependent branch,
distributions validating their arguments, state assigned in forward), the ATen program the forward executes on
this batch is recorded (trace.py, `capture` "trace"), specialised to this batch with the guards it read
listed; a forward calling a custom autograd Function goes through `torch.export.draft_export` instead
(`capture` "draft"), which keeps the Function's backward. An exported program is run on the batch before it is
sent: when its outputs differ from the module's own forward (a library that takes another path while traced), the
forward is recorded instead (replay.export_differs). Inputs may
be nested tuples, lists and dicts of tensors (the graph takes their leaves in order). A model returning
several tensors (a tuple, a Hugging Face ModelOutput) lists them all in `outputs`, their structure in
`output_tree`; `loss="output"` finds the scalar among them (docs/training-code.md).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from gradsvc import wire

from .errors import BadTensorError, UnsupportedModuleError
from .functions import Capture
from .graph import convert_program, reason
from .module_state import restore, snapshot
from .replay import export_differs
from .through import DATA_DEPENDENT, op_name
from .trace import trace_graph
from .graph import state_dict_path as _state_dict_path  # noqa: F401  (tests/client/test_export.py reads it here)
from .tensors import is_tree, several_inputs


@dataclass
class ExportedGraph:
    graph: wire.GraphSpec
    weights: dict[str, torch.Tensor]  # every parameter and buffer the graph reads, by state_dict name
    dynamic_batch: bool = True  # False: the static fallback, valid for the example's batch size only
    frozen: list[str] = field(default_factory=list)  # parameters with requires_grad=False (options.freeze)
    capture: str = "export"  # how it was captured: "export", "export_static", "draft" or "trace" (_captured)
    out_spec: object = None  # forward's output structure (a torch pytree TreeSpec), to rebuild result.outputs
    traced: object = None  # capture "trace": the recording (trace.Traced), whose guards say when it may be reused
    why_not_export: str | None = None  # capture "trace": torch.export's reason


def example_inputs(inputs) -> tuple[tuple, dict]:
    """The SDK's `inputs` as export's (args, kwargs): one tensor, a tuple or list of inputs (positional
    arguments) or a mapping of named inputs (keyword arguments, a Hugging Face batch); each input a tensor or
    a nested tuple, list or dict of tensors (an RNN's (h, c) state)."""
    if not several_inputs(inputs):
        return (_example(inputs, "inputs"),), {}
    if isinstance(inputs, Mapping):
        kwargs = {k: _example_tree(v, f"inputs[{k!r}]") for k, v in inputs.items()}
        if not kwargs:
            raise BadTensorError("inputs: an empty mapping; give the model's inputs by name")
        return (), kwargs
    return tuple(_example_tree(v, f"inputs[{i}]") for i, v in enumerate(inputs)), {}


def _example_tree(v, where: str):
    """One argument of forward: a tensor, or a tuple, list or dict of them (nested), the structure kept."""
    if isinstance(v, Mapping):
        return {k: _example_tree(x, f"{where}[{k!r}]") for k, x in v.items()}
    if is_tree(v):
        return type(v)(_example_tree(x, f"{where}[{i}]") for i, x in enumerate(v))
    return _example(v, where)


def _example(v, where: str) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        if v.layout not in (torch.strided, torch.sparse_coo, torch.sparse_csr):
            raise BadTensorError(f"{where}: a {str(v.layout).removeprefix('torch.')} tensor cannot travel; send it "
                                 "dense, sparse COO (.to_sparse()) or sparse CSR (.to_sparse_csr())")
        return v.detach()
    if isinstance(v, (bool, str, bytes, type(None))):
        raise BadTensorError(f"{where}: cannot send a {type(v).__name__} to an exported module; each input is a "
                             "tensor (a torch tensor, a numpy array or a nested list of numbers), or a tuple, list or "
                             "dict of tensors. Fix non-tensor arguments in the module (a wrapper's forward) before "
                             "sending it")
    try:
        return torch.as_tensor(v)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise BadTensorError(f"{where}: cannot make a tensor of this {type(v).__name__} ({exc}); give a torch "
                             "tensor, a numpy array or a nested list of numbers") from None


def batch_dims(xs: list[torch.Tensor]) -> list[int | None]:
    """Where each input carries the batch: dim 0 when its dim 0 is the first input's (the batch size), dim 1
    when only its dim 1 is (an RNN's (layers, batch, hidden) state), else None (a graph's edge_index
    (2, edges), a mask shared by every example: it goes whole to every part of a split batch)."""
    rows = next((x.shape[0] for x in xs if x.dim() >= 1), None)
    return [None if x.layout != torch.strided else  # a sparse adjacency is the whole graph, shared by its nodes
            0 if x.dim() >= 1 and x.shape[0] == rows else
            1 if x.dim() >= 3 and x.shape[1] == rows else None for x in xs]


def batched_inputs(xs: list[torch.Tensor]) -> list[bool]:
    """Which inputs the wire declares batched (batch_dim 0): those whose dim 0 is the batch (batch_dims)."""
    return [d == 0 for d in batch_dims(xs)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch's loggers held back while export tries: a failed attempt logs the whole graph (pages of stderr),
    and draft_export a report; the SDK says what it did in its own words."""
    # Every torch logger, the artifact loggers torch._logging configures one by one included.
    loggers = [lg for name, lg in logging.root.manager.loggerDict.items()
               if isinstance(lg, logging.Logger) and (name == "torch" or name.startswith("torch."))]
    loggers.append(logging.getLogger("torch"))
    was = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        # A failed trace also prints its partial graph on sys.stderr, past logging.
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            # A tensor attribute assigned in forward (`self.stats = h.mean(0)`) is state the step writes, which an
            # exported graph drops with this warning: an error here, so that the recording captures it.
            warnings.filterwarnings("error", message=r"The tensor attribute .* was assigned during export")
            # nn.GRU/LSTM/RNN re-set their `_flat_weights` list in forward; export warns, yet lifts each weight
            # as the parameter it is.
            warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights")
            yield
    finally:
        for lg, disabled in zip(loggers, was):
            lg.disabled = disabled


def export_graph(module: nn.Module, example_args: tuple | torch.Tensor,
                 example_kwargs: dict | None = None, recorded_because: str | None = None) -> ExportedGraph:
    """`module` captured by torch.export and converted to the wire format, or recorded as its forward runs
    (trace.py) when export cannot; UnsupportedModuleError when neither can. `example_args` are forward's
    positional inputs, `example_kwargs` its keyword inputs (the request then names them); each a tensor or a
    nested tuple, list or dict of them. `recorded_because`: export's reason from an earlier call of this
    module structure, so that it is recorded straight away."""
    if not isinstance(module, nn.Module):
        raise UnsupportedModuleError(f"expected an nn.Module, got {type(module).__name__}")
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    args, kwargs = tuple(example_args), dict(example_kwargs or {})
    xs, tree = pytree.tree_flatten((args, kwargs))
    if not xs or not all(isinstance(x, torch.Tensor) for x in xs) or xs[0].dim() < 1:
        raise UnsupportedModuleError("example inputs must be tensors, the first with a batch dimension (dim 0)")
    dims = batch_dims(xs)
    batched = [d == 0 for d in dims]
    if recorded_because is not None:
        return _traced(module, args, kwargs, batched, recorded_because)
    capture = Capture()
    with _quiet():
        ep, how = _captured(module, args, kwargs, xs, tree, dims, capture)
    if how == "trace":
        return _traced(module, args, kwargs, batched, ep)
    try:
        graph, weights = convert_program(ep, module, batched)
    except UnsupportedModuleError as exc:  # what the exported graph cannot say, the recording may
        if getattr(exc, "final", False):
            raise
        try:
            return _traced(module, args, kwargs, batched, str(exc))
        except UnsupportedModuleError:
            raise exc from None
    differs = export_differs(ep, module, args, kwargs)  # what is sent computes what the module does, or is recorded
    if differs:
        return _traced(module, args, kwargs, batched, differs)
    graph.output_tree = output_tree(ep.call_spec.out_spec, len(graph.outputs))
    if capture.calls:
        used = {n.op.removeprefix("function.") for n in graph.nodes if n.op.startswith("function.")}
        graph.functions = {k: f for k, f in capture.functions().items() if k in used}
    params = dict(module.named_parameters(remove_duplicate=False))
    frozen = [i.target for i in graph.inputs if i.kind == "parameter" and not params[i.target].requires_grad]
    return ExportedGraph(graph=graph, weights=weights, dynamic_batch=how == "export", frozen=frozen, capture=how,
                         out_spec=ep.call_spec.out_spec)


def _traced(module: nn.Module, args: tuple, kwargs: dict, batched: list[bool], why: str) -> ExportedGraph:
    """The recorded program of this batch (trace.py) as an ExportedGraph with capture "trace"."""
    t = trace_graph(module, args, kwargs, batched)
    t.graph.output_tree = output_tree(t.out_spec, len(t.graph.outputs))
    params = dict(module.named_parameters(remove_duplicate=False))
    frozen = [i.target for i in t.graph.inputs if i.kind == "parameter" and not params[i.target].requires_grad]
    return ExportedGraph(graph=t.graph, weights=t.weights, dynamic_batch=False, frozen=frozen, capture="trace",
                         out_spec=t.out_spec, traced=t, why_not_export=why)


def _captured(module: nn.Module, args: tuple, kwargs: dict, xs: list, tree, dims: list, capture: Capture):
    """(the ExportedProgram, how): what torch offers, tried in turn. "export": one graph for every batch size;
    "export_static": for this batch size; "draft": draft_export, for a forward calling a custom autograd
    Function only. When none can, (torch's first reason, "trace"): the caller records the program the forward
    runs (trace.py), which settles each data-dependent branch on the real values."""
    # A batch of one would be specialised to the constant 1; the trace sees only shapes, so a batch of
    # one is traced as two (the example repeated) and the graph still takes any batch size.
    twice = xs[0].shape[0] == 1
    traced = [torch.cat([x, x], dim=d) if d is not None and twice else x for x, d in zip(xs, dims)]
    t_args, t_kwargs = pytree.tree_unflatten(traced, tree)
    batch = torch.export.Dim("batch", min=1)
    d_args, d_kwargs = pytree.tree_unflatten([{d: batch} if d is not None else None for d in dims], tree)
    shapes = d_kwargs if kwargs else tuple(d_args)
    attempts = [("export", lambda: torch.export.export(module, t_args, kwargs=t_kwargs or None,
                                                        dynamic_shapes=shapes)),
                ("export_static", lambda: torch.export.export(module, args, kwargs=kwargs or None)),
                ("draft", lambda: _without_checks(torch.export.draft_export(module, args,
                                                                                 kwargs=kwargs or None)))]
    first = None
    for how, attempt in attempts:
        if how == "draft" and not _has_functions(module, args, kwargs):
            break  # the recording settles branches on the real values (draft_export's guesses can differ)
        try:
            with capture.active():
                ep = attempt()
            if _data_dependent(ep):
                raise RuntimeError("draft_export left an op whose output's size depends on values")
            return ep, how
        except Exception as exc:  # noqa: BLE001  (torch raises many kinds; the first one's reason is kept)
            # The SDK's own refusal of what an export holds (a custom Function taking a Size, a ModuleList, a
            # dict: functions.py) too: the recording takes such a forward, its Functions checked (replay.py)
            first = first or exc
    return reason(first), "trace"


def _has_functions(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether forward calls a custom autograd Function (its backward travels with an exported graph only):
    then draft_export captures a module with data-dependent branches; else the recording does (trace.py)."""
    function = torch.autograd.function.Function
    original, seen = function.__dict__["apply"], []

    def apply(cls, *a, **kw):
        if not cls.__module__.startswith("torch"):
            seen.append(cls)
        return original.__get__(None, cls)(*a, **kw)

    snap = snapshot(module)  # the probe's forward writes the module's state: put back after it
    function.apply = classmethod(apply)
    try:
        copy = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        with torch.no_grad():
            module(*copy[0], **copy[1])
    except Exception:  # noqa: BLE001  (the recording will say what the forward raises)
        return False
    finally:
        function.apply = original
        restore(module, snap)
    return bool(seen)


def _without_checks(ep: "torch.export.ExportedProgram") -> "torch.export.ExportedProgram":
    """A draft export's graph without the runtime checks of the values its branches were settled on (and the
    `item()` reads feeding them): the graph is this call's, sent with this call's inputs only."""
    graph = ep.graph
    for node in list(graph.nodes):
        name = str(node.target)
        if node.op == "call_function" and ("_assert" in name or "sym_constrain_range" in name):
            graph.erase_node(node)
    graph.eliminate_dead_code()
    ep.graph_module.recompile()
    return ep


def _data_dependent(ep: "torch.export.ExportedProgram") -> bool:
    """Whether the graph calls an op whose output's size depends on values (a boolean-mask index, nonzero):
    its size is unbacked in an exported graph, so the recording, which knows it, captures the module instead."""
    for node in ep.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if op_name(node.target) in DATA_DEPENDENT:
            return True
        if node.target is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.fx.Node) and getattr(i.meta.get("val"), "dtype", None) in (torch.bool, torch.uint8)
                for i in (node.args[1] if len(node.args) > 1 else ())):
            return True
    return False


def output_tree(spec, count: int):
    """forward's output structure (`ep.call_spec.out_spec`) as the wire's output_tree: the i-th tensor as i,
    tuples and lists as lists, dicts and ModelOutputs as objects by key; None when it does not map onto the
    graph's `count` outputs."""
    leaves = iter(range(count))

    def walk(s):
        if s.is_leaf():
            return next(leaves, -1)
        kids = [walk(c) for c in s.children()]
        ctx = s.context
        if s.type is type(None):
            return None
        if isinstance(ctx, (list, tuple)) and len(ctx) == len(kids) and all(isinstance(k, str) for k in ctx):
            return dict(zip(ctx, kids))
        return kids

    tree = walk(spec)
    return tree if next(leaves, None) is None and -1 not in _ints(tree) else None


def _ints(tree) -> list[int]:
    if isinstance(tree, int):
        return [tree]
    if isinstance(tree, list):
        return [i for t in tree for i in _ints(t)]
    if isinstance(tree, dict):
        return [i for t in tree.values() for i in _ints(t)]
    return []
