"""A tensor on the wire: dtypes, the Tensor Struct (lists, raw bytes or refs) and its helpers."""

from __future__ import annotations

from typing import Any

from msgspec import Struct

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "bool", "complex64", "complex128")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1, "bool": 1,
            "complex64": 8, "complex128": 16}
# Complex tensors: raw bytes (MessagePack `data`, JSON `b64`) interleave each element's real and imaginary
# parts (little-endian float32 for complex64, float64 for complex128); nested `data` lists hold each element
# as a [real, imaginary] pair (one more dimension of size 2 than `shape`).
COMPLEX_DTYPES = ("complex64", "complex128")


class Tensor(Struct, omit_defaults=True):
    """A tensor on the wire: nested `data` lists or raw little-endian C-order bytes (`data` in
    MessagePack, `b64` in JSON), or `refs`: the sha256 (64 hex digits) of each piece of those raw bytes,
    in order, as uploaded before by PUT /tensors/{sha256} (a tensor sent once, used by reference).

    Raw bytes decode as a memoryview into the message itself, not a copy (a 12.7 MB body: 13 ms -> 1 ms to
    decode): a decoded tensor keeps its whole message alive, so what outlives a request (a graph's constants
    kept with the graph) is copied out of it first (`owned`)."""

    dtype: str
    shape: list[int]
    data: list | memoryview | None = None  # bytes too, as given to the constructor
    b64: str | None = None
    refs: list[str] | None = None
    # A sparse tensor (a graph's sparse input or weight, a sparse parameter's gradient): `layout` "sparse_coo" with `indices` (int64, (len(shape), nnz)) and
    # `values` ((nnz,), of `dtype`), or "sparse_csr" with `crow_indices` ((rows + 1,)), `col_indices` ((nnz,))
    # and `values`; `shape` is the dense shape and the tensor itself carries no data.
    layout: str | None = None
    indices: Tensor | None = None
    values: Tensor | None = None
    crow_indices: Tensor | None = None
    col_indices: Tensor | None = None


def raw_data(t: Tensor) -> "bytes | bytearray | memoryview | None":
    """A tensor's raw bytes as it carries them in `data` (None when `data` is nested lists, or absent)."""
    return t.data if isinstance(t.data, (bytes, bytearray, memoryview)) else None


def owned(tensors: "dict[str, Tensor]") -> None:
    """Each tensor's raw bytes as bytes of their own, no longer a view into the message they came in."""
    for t in tensors.values():
        if isinstance(t.data, memoryview):
            t.data = bytes(t.data)


# A bare nested list (or a scalar) is accepted for inputs and targets.
TensorLike = Tensor | list | float


def by_reference(weights: "dict[str, Tensor] | None", names) -> "dict[str, Tensor]":
    """The weights of `names` sent by reference (`refs`), as given: a training session's frozen base
    (gradsvc/engine/frozen.py)."""
    return {n: t for n, t in (weights or {}).items() if n in names and isinstance(t, Tensor) and t.refs}


def refs_only(weights: "dict[str, Tensor] | None", names) -> "dict[str, Tensor]":
    """by_reference's weights as their refs alone (no bytes): what a training session's record keeps of its frozen
    base, to find it again on another worker."""
    return {n: Tensor(dtype=t.dtype, shape=list(t.shape), refs=list(t.refs))
            for n, t in by_reference(weights, names).items()}


def is_tensor(value: Any) -> bool:
    """A tensor object: the Struct, or (inside a field typed Any: inputs, targets) the plain map of one."""
    return isinstance(value, Tensor) or (isinstance(value, dict) and {"dtype", "shape"} <= set(value))
