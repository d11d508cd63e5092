"""Models a worker keeps on its device between jobs (EngineCaches.resident_models, an LRU bounded by bytes:
EngineConfig.resident_model_bytes), layer specs and graphs alike, on a CPU or a GPU, each with what its weights
were loaded from, so that a weight a request names by the same reference as before (a frozen backbone, a sweep or
several probes over one checkpoint) is found in place: neither fetched, decoded, checked nor copied again.

A model is held per (the model's structure, dtype, device, scope): `scope` is the owner whose jobs built it (the
worker passes the job's owner), so one owner's job never checks out a model another owner's job loaded. Refs are
content hashes and BlobStore.resolved fills a tensor from its owner's own pieces only, so equal refs would mean equal
bytes across owners too; the scope makes it hold without that argument, and keeps one owner from learning what
another holds (a hit's timing).

A weight is in place when the request names it by the same identity (its dtype, shape and the sha256 of each piece;
a small weight sent inline as raw bytes, those bytes; for a layer spec's weight the request leaves out, the seed
it is initialised from) as what was loaded into it, and
the model's tensor is the one loaded, unchanged since: its version counter, which every in-place write bumps (the
HVP check's perturbation), is what it was after the load; a graph never writes a parameter (graph/compiler.py
refuses it). Buffers are always copied in: a training forward writes running statistics, and a kernel that updates
them as a side effect (batch norm's) bumps no counter. A weight sent by other refs or bytes, or changed, is decoded,
checked and copied in: on a GPU through a pinned staging buffer without blocking, the next weight decoded while the
copy runs (prepare's caller synchronises before it reads a clock).

A model is checked out of the pool by prepare (taken: no other compute can see it) and handed back after a
successful compute (release); a failed compute's model is dropped, and running out of memory empties the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hashlib

import msgspec
import torch
from torch import nn

from gradsvc import hashing
from gradsvc.wire import Tensor, raw_data

from . import tensors
from .config import EngineCaches, EngineConfig, state_bytes
from .errors import SpecError

# Weights decoded and copied at a time on a GPU: the copy of one group overlaps the decoding of the next.
COPY_GROUP_BYTES = 16 << 20
STAGING_MAX_BYTES = 256 << 20  # the pinned staging buffer's most (pinned host memory is the OS's to lock)
_ALIGN = 64
# Inline raw bytes up to this size are known by the bytes themselves (kept with the model: a model's small tensors,
# which the SDK sends inline). Larger inline bytes are always copied: keeping them would double the model.
INLINE_IDENTITY_BYTES = 1 << 20


def keeps(device: str | torch.device, config: EngineConfig) -> bool:
    """Whether a model on `device` goes to the resident pool (a real device, and a pool of some bytes)."""
    return torch.device(device).type != "meta" and config.resident_model_bytes > 0


def identity(wire) -> tuple | None:
    """What a wire weight's bytes are known by: (dtype, shape, refs) for one by reference; for a small one sent as
    raw bytes (the SDK sends tensors under 64 KiB in the body: biases, norms), those bytes themselves, so the same
    bytes again are in place too; None otherwise (nested lists, or inline bytes past INLINE_IDENTITY_BYTES: always
    decoded and copied). The bytes are the request's own (a view of its body, maybe): Resident.load keeps a copy."""
    if not isinstance(wire, Tensor):
        return None
    if wire.refs:
        return (wire.dtype, tuple(wire.shape), tuple(wire.refs))
    raw = raw_data(wire)
    if raw is not None and _nbytes(raw) <= INLINE_IDENTITY_BYTES:
        # the bytes themselves, compared (memcmp) rather than hashed: a sha256 of GPT-2's ~100 small tensors took
        # 0.5-3 ms of a resident step's 2 ms prepare; and not copied until kept (a copy of each was 0.1-0.3 ms)
        return (wire.dtype, tuple(wire.shape), "bytes", raw)
    return None


def _nbytes(raw) -> int:
    return raw.nbytes if isinstance(raw, memoryview) else len(raw)


def _equal(was: tuple, known: tuple) -> bool:
    """Whether `was` (kept: its bytes are bytes) and `known` (a request's: its bytes may be a view) name the same
    weight. Bytes are compared with memcmp (bytes.startswith of as many bytes): == on a memoryview compares
    element by element, 50x slower."""
    if len(was) == 4 and len(known) == 4:
        return was[:3] == known[:3] and len(was[3]) == _nbytes(known[3]) and was[3].startswith(known[3])
    return was == known


def _kept(known: tuple | None) -> tuple | None:
    """An identity to keep past the request: its bytes, if any, copied out of the request's buffer."""
    if known is not None and len(known) == 4 and not isinstance(known[3], bytes):
        return (*known[:3], bytes(known[3]))
    return known


def _same_bytes(was: tuple, known: tuple) -> bool:
    """Whether `was`, a weight loaded from inline bytes, holds what `known`, one piece by reference, names: the SDK
    sends a trainable weight in the body first and by reference once it comes back unchanged (hashed once, here)."""
    return (len(was) == 4 and was[2] == "bytes" and len(known) == 3 and len(known[2]) == 1
            and was[:2] == known[:2] and hashlib.sha256(was[3]).hexdigest() == known[2][0])


def unresolved(wire) -> bool:
    """A tensor by reference whose bytes the worker left in Redis (they were in place when it looked)."""
    return isinstance(wire, Tensor) and wire.refs is not None and wire.data is None and wire.b64 is None


@dataclass(eq=False)
class Resident:
    """A model on its device, its state_dict's own tensors (`slots`), the names whose identity is tracked
    (`tracked`: parameters), and per tracked name (identity, tensor, version) of what was loaded into it. `plain`:
    every module loads its state as nn.Module does (else load_state_dict runs, and nothing is tracked). `keep`: it
    may go back to the pool (no state outside its state_dict). `tag`: what else its key does not say (a graph's
    loss output)."""

    model: nn.Module
    tracked: frozenset[str]
    plain: bool = True
    keep: bool = True
    tag: object = None
    slots: dict[str, torch.Tensor] = field(init=False)
    loaded: dict[str, tuple] = field(init=False, default_factory=dict)
    bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.slots = dict(self.model.state_dict(keep_vars=True))
        self.bytes = state_bytes(self.slots)

    def in_place(self, identities: dict[str, tuple | None]) -> set[str]:
        """The names of `identities` (state_dict name -> identity, None: unknown) whose weight is in place."""
        if not self.plain:
            return set()
        out = set()
        for name, known in identities.items():
            was = self.loaded.get(name)
            tensor = self.slots.get(name)
            if known is None or was is None or was[1] is not tensor or was[2] != tensor._version:
                continue
            if _equal(was[0], known):
                out.add(name)
            elif _same_bytes(was[0], known):  # sent inline before, by the ref of the same bytes now
                self.loaded[name] = (known, tensor, was[2])
                out.add(name)
        return out

    def adopt(self, other: "Resident") -> int:
        """Takes over what `other` (the same weights in another program: a graph with another loss output) has in
        place, copied on the device; the bytes copied."""
        copied = 0
        with torch.no_grad():
            for name, (known, tensor, version) in other.loaded.items():
                mine = self.slots.get(name)
                if mine is None or tensor._version != version or mine.shape != tensor.shape:
                    continue
                mine.copy_(tensor)
                copied += mine.numel() * mine.element_size()
                self.loaded[name] = (known, mine, mine._version)
        return copied

    def stale(self, given: dict) -> list[str]:
        """The names of `given` (state_dict name -> wire weight) whose weight is not in place."""
        in_place = self.in_place({n: identity(w) for n, w in given.items()})
        return [n for n in given if n not in in_place]

    def load(self, weights: dict[str, torch.Tensor], identities: dict[str, tuple | None],
             staging: "Staging | None" = None) -> int:
        """Copies `weights` (decoded and checked, on the host) in, remembering each tracked one's identity; the
        bytes copied. A model that does not load plainly gets load_state_dict of its whole state."""
        if not self.plain:
            self.model.load_state_dict(weights)
            return state_bytes(weights)
        copied = 0
        with torch.no_grad():
            for name, value in weights.items():
                tensor = self.slots[name]
                self.loaded.pop(name, None)  # not in place until the copy is done
                if value.layout != torch.strided or tensor.layout != torch.strided:  # a sparse buffer: set, not copied
                    self.model.load_state_dict({**self.model.state_dict(keep_vars=True), name: value})
                    continue
                if staging is not None and tensor.device.type == "cuda":
                    staging.copy(tensor, value)
                else:
                    tensor.copy_(value)
                copied += tensor.numel() * tensor.element_size()
                known = identities.get(name)
                if known is not None and name in self.tracked:
                    self.loaded[name] = (_kept(known), tensor, tensor._version)
        return copied


class Staging:
    """A pinned host buffer that weights go through on their way to a GPU: each copy is queued without blocking
    and its host bytes stay untouched until the caller synchronises (prepare's caller does, once). Grown as
    needed, kept by the Engine between jobs (pinning memory is slow)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.offset = 0

    def reserve(self, nbytes: int) -> None:
        """Room for `nbytes` (up to STAGING_MAX_BYTES) from the start; called once per job, after the last job's
        copies ended (prepare's caller synchronised)."""
        need = min(nbytes, STAGING_MAX_BYTES)
        if self.buffer is None or self.buffer.numel() < need:
            self.buffer = None
            self.buffer = torch.empty(need, dtype=torch.uint8, pin_memory=True)
        self.offset = 0

    def copy(self, target: torch.Tensor, value: torch.Tensor) -> None:
        n = value.numel() * value.element_size()
        start = -(-self.offset // _ALIGN) * _ALIGN
        if self.buffer is None or n > self.buffer.numel():
            target.copy_(value)  # larger than the whole buffer: a plain copy
            return
        if start + n > self.buffer.numel():  # full: wait for the copies queued from it, then start over
            torch.cuda.current_stream(target.device).synchronize()
            start = 0
        host = self.buffer[start:start + n].view(value.dtype).view(value.shape)
        host.copy_(value)
        target.copy_(host, non_blocking=True)
        self.offset = start + n


def staged_bytes(values: dict[str, torch.Tensor] | list) -> int:
    return sum(t.numel() * t.element_size() for t in (values.values() if isinstance(values, dict) else values))


def load_grouped(held: Resident, names: list[str], decode, identities: dict[str, tuple | None],
                 staging: Staging | None, sizes: dict[str, int]) -> int:
    """Decodes and copies `names` into `held` a group at a time (decode: names -> {name: host tensor}); on a GPU
    the copies of one group run while the next is decoded. The bytes copied."""
    if not names:
        return 0
    if not held.plain:  # load_state_dict takes the whole state at once
        return held.load(decode(names), identities)
    if staging is not None:
        staging.reserve(sum(sizes.get(n, 0) for n in names) + _ALIGN * len(names))
    copied, group, group_bytes = 0, [], 0
    for name in names:
        group.append(name)
        group_bytes += sizes.get(name, 0)
        if group_bytes >= COPY_GROUP_BYTES:
            copied += held.load(decode(group), identities, staging)
            group, group_bytes = [], 0
    if group:
        copied += held.load(decode(group), identities, staging)
    return copied


def staging_for(caches: EngineCaches, device: str | torch.device) -> Staging | None:
    """The Engine's pinned staging buffer for copies to a GPU (made the first time); None on a CPU."""
    if torch.device(device).type != "cuda":
        return None
    staging = caches.staging.peek("pinned")
    if staging is None:
        staging = Staging()
        caches.staging.put("pinned", staging)
    return staging


def refuse_unresolved(given: dict, names: list[str]) -> None:
    """A weight the worker left in Redis because it was in place, found not in place (the pool changed between
    the look and the job): a coded error the SDK answers by sending the job again."""
    lost = [n for n in names if unresolved(given.get(n))]
    if lost:
        raise SpecError("tensor_not_found", f"weights {lost[:4]} were held by this worker when it took the job and "
                        "were gone when it ran; send the request again", parameters=lost[:16])


def in_place_weights(caches: EngineCaches, request, device: torch.device, scope: str | None) -> set[str]:
    """Engine.in_place: the request's weights by reference in place in the model held for its key, looked at
    without checking it out (the key as prepare_layers and prepare_graph make it; a graph's loss output aside,
    which prepare checks again)."""
    weights = request.model.weights or {}
    if not any(isinstance(w, Tensor) and w.refs for w in weights.values()):
        return set()
    model = request.model
    dtype = tensors.TORCH_DTYPES.get(model.dtype)
    if model.layers is not None:
        structure = msgspec.json.encode(model.layers)
    elif model.graph_ref is not None:
        structure = model.graph_ref
    elif model.graph is not None:
        structure = hashing.digest(hashing.encode(model.graph))
    else:
        return set()
    held = caches.resident_models.peek((structure, dtype, str(device), scope))
    if held is None:
        return set()
    return held.in_place({n: identity(w) for n, w in weights.items() if isinstance(w, Tensor) and w.refs})


def checkout(caches: EngineCaches, key: tuple, make) -> tuple[Resident, bool]:
    """(the model held under `key`, True) or (a new one from `make()`, False)."""
    held = caches.resident_models.take(key)
    return (held, True) if held is not None else (make(), False)


def release(resident: Resident, key: tuple, caches: EngineCaches) -> bool:
    """Hands a worker's model back for the next request of its key (after compute() succeeded); whether kept."""
    if not resident.keep:
        return False
    caches.resident_models.put(key, resident)
    return caches.resident_models.peek(key) is resident
