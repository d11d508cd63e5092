"""Wire tensors <-> torch tensors: dtype checks, byte/shape agreement, no pickle anywhere."""

from __future__ import annotations

import base64
import binascii
import math
import sys
import warnings
from types import MappingProxyType

import torch

from gradsvc.wire import DTYPES, ITEMSIZE, Tensor, raw_data

from .errors import SpecError

TORCH_DTYPES = MappingProxyType({
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
})
DTYPE_NAMES = MappingProxyType({v: k for k, v in TORCH_DTYPES.items()})
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or infinity. The smallest and the largest element are finite exactly
    when every element is (min and max propagate NaN): one reading pass, where `isfinite(t).all()` first
    writes a bool tensor as large as t (20 ms against 0.5-1.5 ms for 8.4M float32 on this 2-core VM). A sparse
    tensor's stored values are checked."""
    if t.layout == torch.sparse_coo:
        t = t._values()
    elif t.layout == torch.sparse_csr:
        t = t.values()
    if t.is_complex() or (t.is_floating_point() and 0 < t.numel() <= 4096):
        return bool(torch.isfinite(t).all())  # small: two ops, where the min and max path takes five
    if not t.is_floating_point() or t.numel() == 0:
        return True
    with torch.no_grad():
        lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def all_finite_many(ts: list[torch.Tensor]) -> bool:
    """Whether every tensor of `ts` holds no NaN or infinity. On a GPU, one fused reduction and one
    synchronisation for them all (one all_finite each synchronised 199 times a job, 26 ms of GPT-2 small's step
    on an H200); on a CPU, the small ones (a model's biases and norms) in one pass over their concatenation and
    the large ones each (a foreach L1 norm reads a large tensor 6x slower than aminmax here): 250 gradients, two
    of them large, 4.7 -> 1.5 ms on the 2-core VM."""
    if not ts:
        return True
    if all(t.device.type == "cuda" for t in ts):
        return fused_all_finite(ts)
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in ts:
        if (t.device.type == "cpu" and t.is_floating_point() and t.layout == torch.strided
                and 0 < t.numel() <= _SMALL_TENSOR):
            small.setdefault(t.dtype, []).append(t.detach().reshape(-1))
        elif not all_finite(t):
            return False
    return all(all_finite(torch.cat(group) if len(group) > 1 else group[0]) for group in small.values())


_SMALL_TENSOR = 1 << 16  # all_finite_many: a tensor up to this many elements is checked in its dtype's concatenation


def fused_all_finite(ts: list[torch.Tensor]) -> bool:
    """all_finite_many's fused path, on any device: each tensor's L1 norm (one foreach reduction per dtype; NaN
    and infinity propagate through a sum, so finite norms mean finite tensors), read back once. A norm that
    overflows (huge but finite values) is told apart by all_finite on each tensor: the rare path."""
    floats: dict[torch.dtype, list[torch.Tensor]] = {}
    rest = []
    for t in ts:
        if t.is_floating_point() and t.layout == torch.strided and t.numel():
            floats.setdefault(t.dtype, []).append(t.detach())
        elif t.is_complex() or (t.is_floating_point() and t.numel()):
            rest.append(t)
    if any(not all_finite(t) for t in rest):
        return False
    if not floats:
        return True
    norms = [torch.stack(torch._foreach_norm(group, 1, dtype=torch.float32 if dtype.itemsize < 4 else None)).float()
             for dtype, group in floats.items()]
    if bool(torch.isfinite(torch.cat(norms)).all()):
        return True
    return all(all_finite(t) for group in floats.values() for t in group)


def to_host(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of `named` on the host: a GPU's copied in one flat copy per dtype into pinned memory, with
    one synchronisation for them all (a synchronous .cpu() each into pageable memory cost 152 ms of GPT-2
    small's step on an H200); a CPU's as they are. The result's tensors are views of the pinned buffers."""
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for name, t in named.items():
        if t.device.type == "cuda" and t.layout == torch.strided and not t._is_zerotensor():
            groups.setdefault((t.device, t.dtype), []).append(name)
    if not groups:
        return named
    out = dict(named)
    done = {}
    for (device, dtype), names in groups.items():
        host = torch.empty(sum(named[n].numel() for n in names), dtype=dtype, pin_memory=True)
        offset = 0
        for n in names:
            size = named[n].numel()
            out[n] = host[offset:offset + size].view(named[n].shape)
            offset += size
        try:
            flat = torch.cat([named[n].detach().reshape(-1) for n in names])  # one buffer on the device: one copy
            host.copy_(flat, non_blocking=True)
            del flat
        except torch.cuda.OutOfMemoryError:  # no room for the flat buffer: each tensor into its place, no wait
            for n in names:
                out[n].copy_(named[n].detach(), non_blocking=True)
        done[device] = torch.cuda.Event()
        done[device].record(torch.cuda.current_stream(device))
    for event in done.values():  # each device's copies were queued on its stream before its event: one wait each
        event.synchronize()
    return out


def torch_dtype(name: str, *, where: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise SpecError(
            "bad_tensor",
            f"{where}: unknown dtype {name!r}; use one of {', '.join(DTYPES)}",
            where=where,
            dtype=name,
        )
    return TORCH_DTYPES[name]


def decode(value: Tensor | list | float | int, *, where: str, max_elements: int, shape_only: bool = False,
           complex_ok: bool = False) -> torch.Tensor:
    """A wire tensor (or bare nested list/scalar) as a torch tensor; never copies raw bytes twice.

    With `shape_only` (POST /estimate), a tensor given as dtype and shape alone becomes a meta tensor. A complex
    tensor only where `complex_ok` (a graph's inputs, buffers and constants): elsewhere a cast would drop its
    imaginary part.
    """
    if not isinstance(value, Tensor):
        return _from_nested(value, None, where=where, max_elements=max_elements)
    dtype = _wire_dtype(value, where, complex_ok)
    numel = _wire_numel(value.shape, where, max_elements)
    raw = _raw_bytes(value, where)
    if raw is not None:
        return _from_raw(raw, value, dtype, numel, where)
    if value.data is None:
        if shape_only or value.refs is not None:
            # A tensor by reference is checked where its bytes are (the API checks that they exist and add
            # up; a worker puts them in place before the engine): here its dtype and shape stand for it.
            return torch.empty(value.shape, dtype=dtype, device="meta")
        raise SpecError("bad_tensor", f"{where}: give the values in 'data' (nested lists) or 'b64'", where=where)
    return _from_data(value, dtype, where, max_elements)


def by_reference(value: object, *, where: str, max_elements: int, complex_ok: bool = False) -> list[int] | None:
    """The shape of a tensor sent by reference alone (refs, no bytes), its dtype and shape checked as decode()
    checks them, without making the meta tensor decode() would (decode.check_by_reference). None for any other
    value."""
    if (not isinstance(value, Tensor) or value.refs is None or value.data is not None or value.b64 is not None
            or value.layout is not None):
        return None
    _wire_dtype(value, where, complex_ok)
    _wire_numel(value.shape, where, max_elements)
    return value.shape


def _wire_dtype(value: Tensor, where: str, complex_ok: bool) -> torch.dtype:
    dtype = torch_dtype(value.dtype, where=where)
    if dtype.is_complex and not complex_ok:
        raise SpecError("bad_tensor", f"{where}: dtype {value.dtype} is taken only by a graph model's inputs, buffers "
                        "and constants (parameters, targets and layer models are real); send a real dtype, or the "
                        "real and imaginary parts as a last dimension of size 2 (torch.view_as_real)",
                        where=where, dtype=value.dtype)
    return dtype


def _wire_numel(shape: list, where: str, max_elements: int) -> int:
    """The element count of a wire shape, the shape and the count checked against the element limit."""
    if any((not isinstance(n, int)) or n < 0 for n in shape) or len(shape) > 8:
        raise SpecError(
            "bad_tensor",
            f"{where}: shape {shape} is invalid; give at most 8 non-negative integer sizes",
            where=where,
            shape=shape,
        )
    numel = math.prod(shape)
    # A zero size makes numel 0 whatever the others are, but torch still multiplies them all out (as an
    # int64 storage size): [2**64, 0] or [2**62, 4, 0] would overflow it. The other sizes count as well.
    spanned = math.prod(n for n in shape if n)
    if spanned > max_elements and numel == 0:
        raise SpecError(
            "too_large",
            f"{where}: shape {shape} has a zero size, but its other sizes multiply to {spanned}, above the element "
            f"limit of {max_elements}; an empty tensor's other sizes must stay within the limit too",
            where=where,
            shape=shape,
            limit=max_elements,
        )
    if numel > max_elements:
        raise SpecError(
            "too_large",
            f"{where}: {numel} elements exceed the limit of {max_elements}; send a smaller tensor",
            where=where,
            elements=numel,
            limit=max_elements,
        )
    return numel


def _raw_bytes(value: Tensor, where: str):
    """The tensor's bytes (raw, or 'b64' decoded), or None when it gives none."""
    raw = raw_data(value)
    if value.b64 is not None:
        if value.data is not None:
            raise SpecError("bad_tensor", f"{where}: give either 'data' or 'b64', not both", where=where)
        try:
            raw = base64.b64decode(value.b64, validate=True)
        except (binascii.Error, ValueError):
            raise SpecError("bad_tensor", f"{where}: 'b64' is not valid base64", where=where) from None
    return raw


def _from_raw(raw, value: Tensor, dtype: torch.dtype, numel: int, where: str) -> torch.Tensor:
    shape = value.shape
    expected = numel * ITEMSIZE[value.dtype]
    if len(raw) != expected:
        raise SpecError(
            "bad_tensor",
            f"{where}: {len(raw)} bytes for shape {shape} of {value.dtype}; expected {expected} "
            "(little-endian, C order)",
            where=where,
            got_bytes=len(raw),
            expected_bytes=expected,
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = _frombuffer(raw, torch.uint8 if dtype == torch.bool else dtype)
    return flat.view(torch.bool).reshape(shape) if dtype == torch.bool else flat.reshape(shape)


def _from_data(value: Tensor, dtype: torch.dtype, where: str, max_elements: int) -> torch.Tensor:
    """'data' (nested lists) as a tensor of `dtype`, its shape the one the tensor says."""
    shape = value.shape
    tensor = _from_nested(value.data, dtype, where=where, max_elements=max_elements)
    if dtype.is_complex:
        tensor = _complex_from_pairs(tensor, where)
    if list(tensor.shape) != list(shape):
        raise SpecError(
            "bad_tensor",
            f"{where}: data has shape {list(tensor.shape)} but shape says {shape}; make them agree",
            where=where,
            data_shape=list(tensor.shape),
            shape=shape,
        )
    return tensor


_read_only_warned = False  # torch warns once per process about a read-only buffer (TORCH_WARN_ONCE)


def _frombuffer(raw, dtype: torch.dtype) -> torch.Tensor:
    """torch.frombuffer, its warning about a read-only buffer silenced: the engine never writes into a request's
    tensors in place. torch gives that warning once per process, so only until then is it caught (catching it
    costs ~5 us a tensor: a graph's 80 weights, 0.4 ms a request)."""
    global _read_only_warned
    if _read_only_warned or isinstance(raw, bytearray) or (isinstance(raw, memoryview) and not raw.readonly):
        return torch.frombuffer(raw, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(raw, dtype=dtype)
    _read_only_warned = True
    return flat


def _complex_from_pairs(pairs: torch.Tensor, where: str) -> torch.Tensor:
    """Nested [real, imaginary] pairs (read as complex numbers with a zero imaginary part) as complex values."""
    if pairs.dim() == 0 or pairs.shape[-1] != 2:
        raise SpecError("bad_tensor", f"{where}: complex data holds each element as a [real, imaginary] pair; the "
                        f"innermost lists have {pairs.shape[-1] if pairs.dim() else 0} numbers", where=where)
    return torch.view_as_complex(pairs.real.contiguous())


def _from_nested(data, dtype: torch.dtype | None, *, where: str, max_elements: int) -> torch.Tensor:
    if isinstance(data, bool) or not isinstance(data, (list, int, float)):
        raise SpecError("bad_tensor", f"{where}: expected a number or nested list of numbers", where=where)
    try:
        tensor = torch.tensor(data, dtype=dtype)
        if dtype is None and tensor.is_floating_point():
            # JSON numbers are doubles: keep every digit, the model's dtype decides later.
            tensor = torch.tensor(data, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise SpecError(
            "bad_tensor",
            f"{where}: nested lists must be rectangular and hold numbers only ({exc})",
            where=where,
        ) from None
    if tensor.numel() > max_elements:
        raise SpecError(
            "too_large",
            f"{where}: {tensor.numel()} elements exceed the limit of {max_elements}",
            where=where,
            limit=max_elements,
        )
    return tensor


def encode(tensor: torch.Tensor) -> Tensor:
    """A torch tensor as raw bytes on the wire: a view of a CPU tensor's memory, which the encoder copies once
    into the message (a copy to the host first for a device's); nothing may write the tensor after."""
    t = tensor.detach()
    if t.layout != torch.strided:
        return _encode_sparse(t)
    if t._is_zerotensor():  # autograd's zero gradient of sgn, sign, ...: it has no memory to hand to numpy
        t = torch.zeros(t.shape, dtype=t.dtype)
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = DTYPE_NAMES[t.dtype]
    shape = list(t.shape)
    flat = t.reshape(-1)
    if t.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""
    return Tensor(dtype=name, shape=shape, data=raw)


def _encode_sparse(t: torch.Tensor) -> Tensor:
    """A sparse COO tensor (a sparse parameter's gradient) as its indices and values, a CSR one as its
    crow_indices, col_indices and values (the parts a sparse input or weight is sent as)."""
    t = t.cpu()
    name = DTYPE_NAMES[t.dtype]
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        return Tensor(dtype=name, shape=list(t.shape), layout="sparse_coo", indices=encode(t.indices()),
                      values=encode(t.values()))
    if t.layout == torch.sparse_csr:
        return Tensor(dtype=name, shape=list(t.shape), layout="sparse_csr", crow_indices=encode(t.crow_indices()),
                      col_indices=encode(t.col_indices()), values=encode(t.values()))
    return encode(t.to_dense())


def _parts(value: Tensor, each) -> Tensor:
    """A sparse wire tensor with `each` applied to its parts (to_listed, to_b64)."""
    parts = {k: each(getattr(value, k)) for k in ("indices", "values", "crow_indices", "col_indices")
             if getattr(value, k) is not None}
    return Tensor(dtype=value.dtype, shape=value.shape, layout=value.layout, **parts)


# The wire's little-endian dtypes Python reads itself (memoryview.cast), the same numbers torch's tolist gives.
_NATIVE = MappingProxyType({"float64": "d", "float32": "f", "int64": "q", "int32": "i", "uint8": "B", "bool": "?"}
                           if sys.byteorder == "little" else {})


def to_listed(value: Tensor) -> Tensor:
    """Raw bytes -> nested lists, for JSON clients that asked for lists. A dtype Python reads itself is read
    without torch (the 6-8-3 tanh net's four gradients: 0.4 ms through torch, cold between requests)."""
    if value.layout is not None:
        return _parts(value, to_listed)
    raw, code, shape = raw_data(value), _NATIVE.get(value.dtype), value.shape
    if raw is not None and code is not None and all(shape) and len(raw) == math.prod(shape) * ITEMSIZE[value.dtype]:
        flat = memoryview(raw).cast("B").cast(code).tolist()
        for d in reversed(shape[1:]):
            flat = [flat[i:i + d] for i in range(0, len(flat), d)]
        return Tensor(dtype=value.dtype, shape=shape, data=flat if shape else flat[0])
    t = decode(value, where="result", max_elements=1 << 62, complex_ok=True)
    return Tensor(dtype=value.dtype, shape=value.shape, data=(torch.view_as_real(t) if t.is_complex() else t).tolist())


def to_b64(value: Tensor) -> Tensor:
    if value.layout is not None:
        return _parts(value, to_b64)
    raw = raw_data(value) or b""
    return Tensor(dtype=value.dtype, shape=value.shape, b64=base64.b64encode(raw).decode("ascii"))
