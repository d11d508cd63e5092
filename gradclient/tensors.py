"""Arrays <-> wire tensors (raw little-endian C-order bytes), with torch when installed and numpy otherwise.

Sending: a tensor's bytes go to the encoder as a memoryview of the tensor itself, so the one copy is
the encoder writing the body. Receiving: the body is read into one writable buffer, decoded with
`memoryview` in place of `bytes` (`decode_type`), and each tensor is a view into that buffer; only
a tensor whose offset does not suit its dtype's alignment is copied, once.
"""

from __future__ import annotations

import base64
import functools
import sys
import types
import typing
from typing import Any

import msgspec

from gradsvc import wire

try:
    import torch
except ImportError:  # the SDK works without PyTorch: tensors come back as numpy arrays
    torch = None
try:
    import numpy as np
except ImportError:
    np = None

from .errors import BadTensorError

_NUMPY_NAMES = {"float16": "float16", "float32": "float32", "float64": "float64", "int32": "int32",
                "int64": "int64", "uint8": "uint8", "bool": "bool", "complex64": "complex64",
                "complex128": "complex128"}
_COMPLEX_PARTS = {"complex64": "float32", "complex128": "float64"}  # nested data: [real, imaginary] pairs


def is_tensor_like(x: Any) -> bool:
    return (torch is not None and isinstance(x, torch.Tensor)) or (np is not None and isinstance(x, np.ndarray))


def several_inputs(x: Any) -> bool:
    """Several model inputs: a mapping of named inputs (a Hugging Face batch), or a list or tuple whose
    items are all tensors or arrays, or nested tuples, lists or dicts of them (the positional arguments). A
    nested list of numbers is one tensor."""
    if isinstance(x, wire.Tensor):
        return False
    if isinstance(x, typing.Mapping):
        return True
    return isinstance(x, (list, tuple)) and bool(x) and all(_tensor_or_tree(v) for v in x)


def _tensor_or_tree(v: Any) -> bool:
    return is_tensor_like(v) or isinstance(v, wire.Tensor) or is_tree(v) or isinstance(v, typing.Mapping)


def is_tree(v: Any) -> bool:
    """A tuple or list holding tensors (or more of them, nested): an argument such as an LSTM's (h, c)."""
    return isinstance(v, (list, tuple)) and bool(v) and all(_tensor_or_tree(x) for x in v)


def is_nested(x: Any) -> bool:
    """Inputs of which some argument is itself a tuple, list or dict of tensors."""
    values = x.values() if isinstance(x, typing.Mapping) else x if isinstance(x, (list, tuple)) else []
    return any(is_tree(v) or isinstance(v, typing.Mapping) for v in values)


def input_leaves(x: Any, where: str = "inputs") -> list[tuple[str, Any]]:
    """(where, tensor) of every tensor in nested inputs, in the order torch.export flattens them (the graph's
    inputs): tuples and lists in order, dicts by key in insertion order."""
    if isinstance(x, typing.Mapping):
        return [leaf for k, v in x.items() for leaf in input_leaves(v, f"{where}[{k!r}]")]
    if isinstance(x, (list, tuple)) and (where == "inputs" or is_tree(x)):
        return [leaf for i, v in enumerate(x) for leaf in input_leaves(v, f"{where}[{i}]")]
    return [(where, x)]


def inputs_to_wire(x: Any, fmt: str = "msgpack") -> Any:
    """A request's `inputs`: one tensor, a list of tensors (positional) or an object of named tensors; nested
    inputs as the list of their tensors in the graph's order."""
    if several_inputs(x) and is_nested(x):
        return [_one(v, where, fmt) for where, v in input_leaves(x)]
    if several_inputs(x):
        if isinstance(x, typing.Mapping):
            return {_name(k): _one(v, f"inputs[{k!r}]", fmt) for k, v in x.items()}
        return [_one(v, f"inputs[{i}]", fmt) for i, v in enumerate(x)]
    return _one(x, "inputs", fmt)


def _name(key: Any) -> str:
    if not isinstance(key, str):
        raise BadTensorError(f"inputs: the key {key!r} is a {type(key).__name__}; name each input by a string "
                             "(forward's argument name)")
    return key


def _one(x: Any, where: str, fmt: str) -> Any:
    if isinstance(x, (list, tuple)) and where != "inputs":
        raise BadTensorError(f"{where}: a {type(x).__name__} inside several inputs; give each input as a torch "
                             "tensor or a numpy array")
    if isinstance(x, (bool, str, bytes, type(None), dict)) or not (isinstance(x, (wire.Tensor, list, int, float))
                                                                  or is_tensor_like(x)):
        raise BadTensorError(f"{where}: cannot send a {type(x).__name__}; inputs are one tensor (a torch tensor, a "
                             "numpy array or a nested list of numbers), a tuple or list of tensors (the model's "
                             "positional arguments) or a dict of named tensors (its keyword arguments)")
    return to_wire(list(x) if isinstance(x, tuple) else x, fmt)


def to_wire(x: Any, fmt: str = "msgpack") -> Any:
    """A torch tensor or numpy array as a wire.Tensor (raw bytes in msgpack, base64 in JSON); numbers
    and nested lists pass through, as the API accepts them for inputs and targets."""
    if isinstance(x, wire.Tensor) or isinstance(x, (list, int, float)):
        return x
    if torch is not None and isinstance(x, torch.Tensor) and x.layout != torch.strided:
        return _sparse(x, fmt)
    if torch is not None and isinstance(x, torch.Tensor):
        name, shape, raw = _torch_bytes(x)
    elif np is not None and isinstance(x, np.ndarray):
        name, shape, raw = _numpy_bytes(x)
    else:
        raise BadTensorError(f"cannot send a {type(x).__name__}; give a torch tensor, a numpy array or a nested list")
    if fmt == "json":
        return wire.Tensor(dtype=name, shape=shape, b64=base64.b64encode(raw).decode("ascii"))
    return wire.Tensor(dtype=name, shape=shape, data=raw)  # a memoryview: msgspec writes it as bin


def _sparse(x: "torch.Tensor", fmt: str) -> wire.Tensor:
    """A sparse COO tensor as (indices, values), a CSR one as (crow_indices, col_indices, values)."""
    name = str(x.dtype).removeprefix("torch.")
    if x.layout == torch.sparse_coo:
        x = x.coalesce()
        return wire.Tensor(dtype=name, shape=list(x.shape), layout="sparse_coo", indices=to_wire(x.indices(), fmt),
                           values=to_wire(x.values(), fmt))
    if x.layout == torch.sparse_csr:
        return wire.Tensor(dtype=name, shape=list(x.shape), layout="sparse_csr",
                           crow_indices=to_wire(x.crow_indices(), fmt), col_indices=to_wire(x.col_indices(), fmt),
                           values=to_wire(x.values(), fmt))
    raise BadTensorError(f"a tensor of layout {x.layout} cannot travel; send it dense, sparse COO or sparse CSR")


def _torch_bytes(x: "torch.Tensor") -> tuple[str, list[int], memoryview]:
    t = x.detach()
    name = str(t.dtype).removeprefix("torch.")
    if name not in wire.ITEMSIZE:
        raise BadTensorError(f"dtype {t.dtype} cannot travel; use one of {', '.join(wire.DTYPES)}")
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()  # a no-op for the usual contiguous tensor
    if sys.byteorder != "little" and name != "bfloat16":  # pragma: no cover - numpy swaps the bytes
        return _numpy_bytes(t.numpy())
    flat = t.reshape(-1).view(torch.uint8)  # (numel * itemsize,), the same memory
    return name, list(t.shape), memoryview(flat.numpy())


def _numpy_bytes(a: "np.ndarray") -> tuple[str, list[int], memoryview]:
    name = a.dtype.name
    if name not in _NUMPY_NAMES:
        raise BadTensorError(f"numpy dtype {a.dtype} cannot travel; use one of {', '.join(_NUMPY_NAMES)}")
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder != "little"):
        a = a.astype(a.dtype.newbyteorder("<"))
    return name, list(a.shape), memoryview(a.reshape(-1).view(np.uint8))


def from_wire(t: Any) -> Any:
    """A decoded wire tensor (data a memoryview into the body, nested lists, or b64) as a torch tensor
    (numpy array without torch). None stays None."""
    if t is None:
        return None
    if getattr(t, "layout", None) is not None:
        return _sparse_from_wire(t)
    raw = wire.raw_data(t)
    if t.b64 is not None:
        raw = memoryview(bytearray(base64.b64decode(t.b64)))
    if raw is None:
        return _from_list(t)
    return _from_torch_bytes(t, raw) if torch is not None else _from_numpy_bytes(t, raw)


def _sparse_from_wire(t: Any) -> Any:
    """A sparse wire tensor (a sparse parameter's gradient) as the torch sparse tensor of its layout."""
    if torch is None:
        raise BadTensorError(f"a {t.layout} tensor needs torch to read it")
    shape, values = list(t.shape), from_wire(t.values)
    if t.layout == "sparse_coo":
        return torch.sparse_coo_tensor(from_wire(t.indices), values, shape).coalesce()
    if t.layout == "sparse_csr":
        return torch.sparse_csr_tensor(from_wire(t.crow_indices), from_wire(t.col_indices), values, shape)
    raise BadTensorError(f"a tensor of layout {t.layout!r}: this SDK reads sparse_coo and sparse_csr")


def _from_list(t: Any) -> Any:
    if t.dtype in _COMPLEX_PARTS:
        if torch is not None:
            pairs = torch.tensor(t.data, dtype=getattr(torch, _COMPLEX_PARTS[t.dtype]))
            return torch.view_as_complex(pairs.reshape(*t.shape, 2))
        return np.asarray(t.data, dtype=_COMPLEX_PARTS[t.dtype]).reshape(*t.shape, 2).view(t.dtype)[..., 0]
    if torch is not None:
        dtype = getattr(torch, t.dtype)
        return torch.tensor(t.data, dtype=dtype).reshape(t.shape)
    if t.dtype == "bfloat16":
        return np.asarray(t.data, dtype=np.float32).reshape(t.shape)
    return np.asarray(t.data, dtype=_NUMPY_NAMES[t.dtype]).reshape(t.shape)


def _from_torch_bytes(t: Any, raw: memoryview | bytes) -> "torch.Tensor":
    dtype = getattr(torch, t.dtype)
    if len(raw) == 0:
        return torch.empty(t.shape, dtype=dtype)
    u8 = torch.frombuffer(raw, dtype=torch.uint8)  # a view of the body, no copy
    misaligned = u8.data_ptr() % wire.ITEMSIZE[t.dtype]
    if misaligned or getattr(raw, "readonly", True):
        moved = _realigned(t, raw, misaligned) if misaligned else None
        # Misaligned for its dtype and not movable, or read-only: one copy into a fresh, aligned tensor.
        u8 = torch.frombuffer(moved, dtype=torch.uint8) if moved is not None else u8.clone()
    return u8.view(dtype).reshape(t.shape)


def _realigned(t: Any, raw: Any, by: int) -> memoryview | None:
    """A misaligned tensor's bytes moved `by` bytes back within the writable answer they are a view of, onto
    its own MessagePack header (`"data"` and the bin's type and length: 7 bytes at least, and `by` is below the
    itemsize, at most 8): a memmove within memory already in use, where a copy takes fresh memory (12.6 MB:
    1-3 ms, more when the kernel must find the pages). The header is checked first; `t.data` is the moved view
    afterwards. None (copy instead) when the bytes are not laid out so."""
    owners = (bytearray, np.ndarray) if np is not None else (bytearray,)
    if not isinstance(raw, memoryview) or raw.readonly or not isinstance(raw.obj, owners):
        return None
    whole = memoryview(raw.obj).cast("B")
    start = torch.frombuffer(raw, dtype=torch.uint8).data_ptr() - \
        torch.frombuffer(whole, dtype=torch.uint8).data_ptr()
    n = len(raw)
    size = 5 if n > 0xFFFF else 3 if n > 0xFF else 2
    head = start - size
    if head - 5 < 0 or start + n > len(whole) or bytes(whole[head - 5:head]) != b"\xa4data" or \
            bytes(whole[head:start]) != {5: b"\xc6", 3: b"\xc5", 2: b"\xc4"}[size] + n.to_bytes(size - 1, "big"):
        return None
    whole[start - by:start - by + n] = raw  # overlapping: memoryview assignment moves
    t.data = moved = whole[start - by:start - by + n]
    return moved


def _from_numpy_bytes(t: Any, raw: memoryview | bytes) -> "np.ndarray":
    if t.dtype == "bfloat16":  # numpy has no bfloat16: widen to float32 exactly (the high 16 bits)
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
    a = np.frombuffer(raw, dtype=np.dtype(_NUMPY_NAMES[t.dtype]).newbyteorder("<"))
    if not a.flags.aligned or not a.flags.writeable:
        a = a.copy()
    return a.reshape(t.shape)


@functools.cache
def decode_type(tp: Any) -> Any:
    """The wire type `tp` with every `bytes` field decoded as a memoryview into the message buffer (the
    same Structs, derived, so gradsvc.wire stays the one definition)."""
    return _derived(tp, frozenset())


def _derived(tp: Any, within: frozenset) -> Any:
    """`decode_type` of `tp` inside the Structs `within` (those being derived around it)."""
    if tp is bytes:
        return memoryview
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        if tp in within:  # a Struct inside itself (a sparse Tensor's parts): kept, it holds no bytes field
            return tp
        fields = msgspec.structs.fields(tp)
        new = [(f.name, _derived(f.type, within | {tp})) for f in fields]
        if all(n[1] == f.type for n, f in zip(new, fields)):
            return tp
        spec = []
        for (name, ftype), f in zip(new, fields):
            if f.default is not msgspec.NODEFAULT:
                spec.append((name, ftype, f.default))
            elif f.default_factory is not msgspec.NODEFAULT:
                spec.append((name, ftype, msgspec.field(default_factory=f.default_factory)))
            else:
                spec.append((name, ftype))
        return msgspec.defstruct(tp.__name__, spec, module=__name__)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is None or not args:
        return tp
    new_args = tuple(_derived(a, within) for a in args)
    if new_args == args:
        return tp
    if origin in (typing.Union, types.UnionType):
        return typing.Union[new_args]
    return origin[new_args]
