"""Weights sent by reference: a large tensor goes up once, in pieces (PUT /tensors/{sha256}), and a request
names its pieces (`{"dtype", "shape", "refs": [...]}`) instead of carrying its bytes.

The digests of a tensor are computed again only when the tensor changed since they were computed: torch
counts in-place writes in `tensor._version` (an optimizer step, `copy_`, `add_`), and a new storage moves
`data_ptr()`; a frozen backbone is hashed once.

A tensor that changed since the client last sent it, or a weight that trains (requires_grad) sent for the
first time, goes in the body instead, up to INLINE_BYTES a request: it will change again before the next
call, so pieces would cost two trips (PUT, then the worker's read from Redis) and the store's memory for
bytes used once (bench/large_model.py, every weight trained: 1.7x local by reference). Sent again unchanged
(a sweep, several probes of one checkpoint), it goes by reference from then on. What the service holds is
remembered per client; a piece it lost (expired, evicted) is a 422 `tensor_not_found`, which the client
answers by uploading again, once.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

from gradsvc import wire

from .tensors import _torch_bytes

PIECE_BYTES = 32 << 20  # well under GRADSVC_MAX_BODY_BYTES: a piece is one PUT
MIN_BYTES = 64 << 10  # smaller tensors go in the body, as before
INLINE_BYTES = 128 << 20  # changing weights in one body at most: half of GRADSVC_MAX_BODY_BYTES's default


class TensorRefs:
    def __init__(self, min_bytes: int = MIN_BYTES, piece_bytes: int = PIECE_BYTES) -> None:
        self.min_bytes, self.piece_bytes = min_bytes, piece_bytes
        self.uploaded: set[str] = set()  # pieces this client sent to the service (and has not heard it lost)
        # id(tensor) -> (weakref, state, digests; None while it went in the body)
        self._known: dict[int, tuple[Any, tuple, list[str] | None]] = {}
        self.hashed_bytes = 0  # bytes hashed so far (what "only what changed" saves shows here)

    def wire(self, t: Any) -> tuple[wire.Tensor, list[tuple[str, memoryview]]] | None:
        """`t` by reference and its pieces the service does not hold yet, or None for a small tensor."""
        if t.numel() * t.element_size() < self.min_bytes:
            return None
        name, shape, raw = _torch_bytes(t)
        digests = self._digests(t, raw)
        step = self.piece_bytes
        pending = [(d, raw[i * step:(i + 1) * step]) for i, d in enumerate(digests) if d not in self.uploaded]
        return wire.Tensor(dtype=name, shape=shape, refs=digests), pending

    def changing(self, t: Any) -> bool:
        """Whether `t` is a large tensor that changed since the client last sent it (an optimizer step, a
        BatchNorm's running statistics), or a weight that trains sent for the first time: then it goes in
        the body (see above). Its state now is remembered either way."""
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        state, hit = self._entry(t)
        if (hit is not None and hit[1] == state) or (hit is None and not getattr(t, "requires_grad", False)):
            return False
        self._remember(t, state, None)
        return True

    def _entry(self, t: Any) -> tuple[tuple, tuple | None]:
        """`t`'s state now (its version counter, storage, shape, dtype, device) and what was remembered of
        this very tensor (None if nothing, or only of another one since gone whose id it reuses)."""
        state = (t._version, t.data_ptr(), tuple(t.shape), str(t.dtype), str(t.device))
        hit = self._known.get(id(t))
        return state, hit if hit is not None and hit[0]() is t else None

    def _remember(self, t: Any, state: tuple, digests: list[str] | None) -> None:
        if len(self._known) > 100_000:  # drop the entries of tensors gone since
            self._known = {k: v for k, v in self._known.items() if v[0]() is not None}
        self._known[id(t)] = (weakref.ref(t), state, digests)

    def _digests(self, t: Any, raw: memoryview) -> list[str]:
        state, hit = self._entry(t)
        if hit is not None and hit[1] == state and hit[2] is not None:
            return hit[2]
        step = self.piece_bytes
        digests = [hashlib.sha256(raw[a:a + step]).hexdigest() for a in range(0, len(raw), step)]
        self.hashed_bytes += len(raw)
        self._remember(t, state, digests)
        return digests

    def forget(self, digests: list[str]) -> None:
        self.uploaded.difference_update(digests)
