"""An exported graph as plain data: its inputs, nodes, custom autograd Functions (model.graph)."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from gradsvc.wire.tensors import Tensor


class GraphInput(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One input of an exported graph (a placeholder of `torch.export`'s graph). `name` is what the
    nodes refer to; `target` is the state_dict name (parameter, buffer) or the `constants` key.
    `dtype` and `shape` are the captured tensor's: a parameter's or buffer's exactly (the graph model is
    built on the meta device from them, before any weight is decoded), a user input's as in the example
    it was exported with, -1 for a dynamic size ("int64" inputs are token ids or indices). The user inputs,
    in order, are `forward`'s arguments: a request's `inputs` gives them as a list in that order or as an
    object by `name`."""

    name: str
    kind: Literal["input", "parameter", "buffer", "constant"]
    target: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    # A user input's batch dimension: 0, or null for an input without one (a graph's edge_index, a mask
    # shared by every example), which goes whole to every micro-batch, shard and per-example gradient.
    batch_dim: Literal[0] | None = 0
    # A sparse user input, buffer or parameter: "sparse_coo" or "sparse_csr" (the request sends it, or its weight,
    # in that layout: its parts; a sparse parameter's gradient comes back so); null: dense.
    layout: Literal["sparse_coo", "sparse_csr"] | None = None


class OpNode(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One call in an exported graph: `op` is an allow-listed ATen overload ("aten.linear.default") or
    one of the few Python operators export emits ("operator.getitem", "operator.mul", ...).

    Arguments are plain data: a JSON scalar (int, float, bool, null, string), a list of arguments,
    `{"node": name}` (an input's or an earlier node's value), `{"float": "inf"|"-inf"|"nan"}`,
    `{"dtype": "float32"}`, `{"device": "cpu"}`, `{"layout": "strided"}` or
    `{"memory_format": "contiguous_format"}`. `module` is the module path the call ran in (from
    `nn_module_stack`, "" for the root module) and `module_type` that module's class name."""

    name: str
    op: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    module: str = ""
    module_type: str = ""
    # The output's size at capture, for an op whose output's shape depends on values (`nonzero`, a boolean-mask
    # index) in a graph specialised to one batch: the shape check takes it, the run checks it.
    shape: list[int] | None = None


Capture = Literal["export", "export_static", "draft", "trace"]


class CapturedInput(Struct, forbid_unknown_fields=True):
    """A user input's shape and dtype as the capture saw them (a guard of a specialised capture)."""

    shape: list[int]
    dtype: str


class Specialised(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a captured graph is specialised to: its guards, which the capturing client checks before it reuses
    the graph (by `graph_ref`) and records again when one does not hold. `inputs`: each user input's shape and
    dtype ("export_static", "draft", "trace"); "trace" only: `values`, each value Python read out of a tensor
    (`bool()`, `item()`, an `if` on a tensor, the argument checks of `torch.distributions`), by the read and the
    node it read ("is_nonzero(gt)": true); `sizes`, the size each data-dependent output had (`nonzero`, a
    boolean-mask index), by node; `constants`, tensors made outside torch's ops in forward whose values the graph
    holds (recorded again on every call)."""

    inputs: list[CapturedInput] = []
    values: dict[str, bool | int | float | None] = {}
    sizes: dict[str, list[int]] = {}
    constants: list[str] = []


class GraphSpec(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A model captured by `torch.export`, or recorded as its forward ran, as plain data (format version 1).
    `outputs` are the user outputs (arguments as in OpNode.args; the loss applies to the first);
    `buffer_mutations` maps a buffer's state_dict name to the node whose value the buffer takes after the
    forward pass (batch norm's running statistics); `dtype` is the floating dtype the graph was captured in."""

    inputs: list[GraphInput]
    nodes: list[OpNode]
    outputs: list[Any]
    dtype: str = "float32"
    constants: dict[str, Tensor] = {}
    buffer_mutations: dict[str, str] = {}
    version: int = 1
    # The structure forward returns, over `outputs`: an integer is outputs[i], a list a tuple or list, an
    # object a dict or ModelOutput (by key), null a None. Absent: the outputs as a flat tuple. It names the
    # outputs `loss: {"output": ...}` may pick and shapes `result.outputs`.
    output_tree: Any = None
    # Custom autograd Functions the nodes call (op "function.<key>"), by key.
    functions: dict[str, FunctionSpec] = {}
    # How the client captured the module: "export" (torch.export with a dynamic batch: any batch size),
    # "export_static" (torch.export at this batch size), "draft" (draft_export: this call's branches), "trace" (the
    # ATen program the forward ran on this batch, recorded as it ran); null: not said (a graph written by hand).
    # `specialised`: its guards (null for "export"). The service echoes both in the result and checks neither.
    capture: Capture | None = None
    specialised: Specialised | None = None


class FunctionSpec(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A custom `torch.autograd.Function` a graph calls: an OpNode with op "function.<key>" and args
    `[[{"node": x}, ...]]` (its tensor arguments) returns its outputs (picked by operator.getitem).
    `forward` maps the tensor arguments to the outputs; `backward` maps (the tensor arguments, then one
    gradient per output) to the gradients of the arguments `grads` marks true (the others get none).
    Both are graphs of allowed ops with inputs of kind "input" and "constant" only; `name` is the
    Function's class name, for messages."""

    name: str
    forward: GraphSpec
    backward: GraphSpec
    grads: list[bool]
