"""Tensors by reference: pieces of tensor bytes uploaded once (PUT /tensors/{sha256}) and named by their
sha256 in a request's tensors (`{"dtype", "shape", "refs": [sha256, ...]}`), as graph_ref names a graph.

A piece is stored per owner (API key) under keys.blob_key with a TTL (GRADSVC_TENSOR_TTL_S) that each use
refreshes, within a byte budget per owner (GRADSVC_TENSOR_BUDGET_BYTES: over it, the owner's least
recently used pieces go; the weights the owner's training runs keep count in it too, gradsvc/broker/runs.py). Every worker reads them from Redis, and keeps the pieces it used in a local
LRU bounded by bytes (GRADSVC_TENSOR_CACHE_BYTES), so a frozen backbone stays on the worker between
calls. A reference another owner sent, or one that expired or was evicted, is unknown: a 422
`tensor_not_found` that the SDK answers by uploading the pieces again. No torch here, no Redis import:
the store is handed a client.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any, Iterator

from gradsvc.broker import keys
from gradsvc.lru import LRU
from gradsvc.wire import ITEMSIZE, GradientRequest, Tensor
from gradsvc.wire import is_tensor as _is_tensor

DIGEST = re.compile(r"[0-9a-f]{64}")

# BlobStore.check in one command: each piece's size (0: not kept), its TTL refreshed, and its place in the
# owner's LRU index moved to now (ZADD XX: a piece the index lost is not added back); the index and the sizes
# hash get the same TTL, so they live as long as the pieces they count (else the budget forgets pieces still
# in use once the upload's TTL passes). KEYS: the index, the sizes hash, then the pieces' keys; ARGV: the TTL,
# now, then the refs (the index's members), in KEYS' order. A frozen backbone's
# 32 refs as a pipeline of 65 commands took 2.5-4.7 ms of the API's request path, most of it redis-py's
# per-reply work; the ZADD goes in batches that stay under Lua's unpack limit.
_CHECK = """
local ttl, now = ARGV[1], ARGV[2]
local sizes = {}
for i = 3, #KEYS do
  sizes[i - 2] = redis.call('STRLEN', KEYS[i])
  redis.call('EXPIRE', KEYS[i], ttl)
end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
local args = {}
for i = 3, #ARGV do
  args[#args + 1] = now
  args[#args + 1] = ARGV[i]
  if #args >= 2000 or i == #ARGV then
    redis.call('ZADD', KEYS[1], 'XX', unpack(args))
    args = {}
  end
end
return sizes
"""


# GRADSVC_MAX_REFS's default: the refs one request may name. Checking them is one Redis script, which holds
# Redis (every key's requests) for ~2 us a ref: 1.8 million took 3.9 s; 4,096 take ~10 ms, and a 200M-parameter
# model goes up in a few hundred pieces.
MAX_REFS = 4096


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def request_tensors(req: GradientRequest) -> Iterator[tuple[str, Any]]:
    """(where, value) of every tensor a request carries: the weights, the inputs (one, a list, an object),
    the targets (one or an object) and the HVP vector. Values may be wire Tensors or their plain dicts."""
    for name, t in (req.model.weights or {}).items():
        yield f"model.weights[{name!r}]", t
    yield from _each("inputs", req.inputs)
    yield from _each("targets", req.targets)
    hvp = req.options.hvp
    if hvp is not None and isinstance(hvp.vector, dict):
        for name, t in hvp.vector.items():
            yield f"options.hvp.vector[{name!r}]", t


def _each(where: str, value: Any) -> Iterator[tuple[str, Any]]:
    if _is_tensor(value):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            if _is_tensor(v):
                yield f"{where}.{k}", v
    elif isinstance(value, list) and value and all(_is_tensor(v) for v in value):
        for i, v in enumerate(value):
            yield f"{where}[{i}]", v


def refs_of(value: Any) -> list[str] | None:
    return value.refs if isinstance(value, Tensor) else (value.get("refs") if isinstance(value, dict) else None)


def has_refs(req: GradientRequest) -> bool:
    return any(refs_of(v) is not None for _, v in request_tensors(req))


class BlobError(Exception):
    """A reference that cannot be used: `code` (tensor_not_found, bad_tensor) and what to say."""

    def __init__(self, code: str, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.code, self.message, self.detail = code, message, detail


def _inline(value: Any) -> bool:
    """Whether a tensor gives bytes or values of its own ('data' or 'b64')."""
    if isinstance(value, Tensor):
        return value.data is not None or value.b64 is not None
    return value.get("data") is not None or value.get("b64") is not None


def _expected_bytes(value: Any) -> int:
    shape = value.shape if isinstance(value, Tensor) else value.get("shape")
    dtype = value.dtype if isinstance(value, Tensor) else value.get("dtype")
    n = 1
    for s in shape or []:
        n *= int(s) if isinstance(s, int) and s >= 0 else 0
    return n * ITEMSIZE.get(dtype, 0)


class BlobStore:
    """The owners' pieces in Redis (put, missing, check, fetch), with a local LRU of what was fetched."""

    def __init__(self, redis, prefix: str, ttl_s: int, budget_bytes: int, cache_bytes: int = 0,
                 max_refs: int = MAX_REFS) -> None:
        self.redis, self.prefix, self.ttl_s, self.budget_bytes = redis, prefix, ttl_s, budget_bytes
        self.max_refs = max_refs
        self.cache: LRU[bytes] = LRU(max_bytes=cache_bytes)
        self.evictions = 0
        self._check = redis.register_script(_CHECK)

    def put(self, owner: str, ref: str, data: bytes) -> int:
        """Stores one piece (its digest checked by the caller); returns how many of the owner's least
        recently used pieces the budget evicted to make room."""
        if not len(data):
            raise BlobError("bad_tensor", "an empty piece (0 bytes) names no bytes: a tensor with no elements needs no "
                            "refs; send it inline ({\"dtype\", \"shape\", \"data\": []})", bytes=0)
        if len(data) > self.budget_bytes:
            raise BlobError("too_large", f"a piece of {len(data)} bytes is over GRADSVC_TENSOR_BUDGET_BYTES="
                            f"{self.budget_bytes}; upload it in smaller pieces", bytes=len(data),
                            limit=self.budget_bytes)
        index, sizes = keys.blob_index_key(self.prefix, owner), keys.blob_sizes_key(self.prefix, owner)
        pipe = self.redis.pipeline()
        pipe.set(keys.blob_key(self.prefix, owner, ref), data, ex=self.ttl_s)
        pipe.zadd(index, {ref: time.time()})
        pipe.hset(sizes, ref, len(data))
        pipe.expire(index, self.ttl_s)
        pipe.expire(sizes, self.ttl_s)
        pipe.hvals(sizes)
        pipe.hvals(keys.run_weights_sizes_key(self.prefix, owner))  # the owner's runs' kept weights count too
        *_, pieces, runs = pipe.execute()
        total = sum(int(v) for v in pieces) + sum(int(v) for v in runs)
        evicted = 0
        while total > self.budget_bytes:
            oldest = self.redis.zpopmin(index)
            if not oldest:
                break
            old = oldest[0][0].decode() if isinstance(oldest[0][0], bytes) else oldest[0][0]
            if old == ref:  # the piece just stored is the newest: the rest went already
                self.redis.zadd(index, {ref: time.time()})
                break
            size = self.redis.hget(sizes, old)
            pipe = self.redis.pipeline()
            pipe.delete(keys.blob_key(self.prefix, owner, old))
            pipe.hdel(sizes, old)
            pipe.execute()
            total -= int(size or 0)
            evicted += 1
        self.evictions += evicted
        return evicted

    def missing(self, owner: str, refs: list[str]) -> list[str]:
        """The refs of `refs` this owner has not uploaded (or whose pieces expired or were evicted)."""
        if not refs:
            return []
        pipe = self.redis.pipeline()
        for ref in refs:
            pipe.exists(keys.blob_key(self.prefix, owner, ref))
        return [ref for ref, there in zip(refs, pipe.execute()) if not there]

    def check(self, owner: str, req: GradientRequest) -> None:
        """Every ref of the request is this owner's and its pieces add up to the tensor's bytes (the API,
        before the queue; each use refreshes the pieces' TTL). BlobError otherwise."""
        tensors = [(where, v, refs_of(v)) for where, v in request_tensors(req) if refs_of(v) is not None]
        if not tensors:
            return
        count = sum(len(refs) if isinstance(refs, list) else 1 for _, _, refs in tensors)
        if count > self.max_refs:
            raise BlobError("too_many_refs", f"the request names {count} tensor pieces by reference, over the limit "
                            f"of {self.max_refs} (GRADSVC_MAX_REFS); upload larger pieces (up to "
                            "GRADSVC_MAX_BODY_BYTES each) so each tensor needs fewer refs", count=count,
                            limit=self.max_refs)
        for where, value, refs in tensors:
            if _inline(value):
                raise BlobError("bad_tensor", f"{where}: give the tensor's bytes either inline ('data' or 'b64') or "
                                "by reference ('refs'), not both", where=where)
            bad = next((r for r in refs if not isinstance(r, str) or not DIGEST.fullmatch(r)), None)
            if bad is not None or not refs:
                raise BlobError("bad_tensor", f"{where}: refs must be a non-empty list of sha256 digests (64 "
                                f"lowercase hex digits) as PUT /tensors/{{sha256}} took them, got "
                                f"{str(bad)[:80]!r}", where=where)
        unique = list(dict.fromkeys(r for _, _, refs in tensors for r in refs))
        answers = self._check(keys=[keys.blob_index_key(self.prefix, owner), keys.blob_sizes_key(self.prefix, owner),
                                    *(keys.blob_key(self.prefix, owner, ref) for ref in unique)],
                              args=[self.ttl_s, repr(time.time()), *unique])
        sizes = dict(zip(unique, answers))
        lost = [r for r in unique if not sizes[r]]
        if lost:
            raise BlobError("tensor_not_found", f"{len(lost)} tensor piece(s) named by refs are not kept here "
                            f"(never uploaded by this API key, expired after GRADSVC_TENSOR_TTL_S or evicted by "
                            f"GRADSVC_TENSOR_BUDGET_BYTES): {', '.join(r[:12] for r in lost[:4])}"
                            f"{' ...' if len(lost) > 4 else ''}; upload them again with PUT /tensors/{{sha256}}",
                            refs=lost[:64])
        for where, value, refs in tensors:
            got, want = sum(int(sizes[r]) for r in refs), _expected_bytes(value)
            if got != want:
                raise BlobError("bad_tensor", f"{where}: its refs hold {got} bytes, its dtype and shape need {want}",
                                where=where, got_bytes=got, expected_bytes=want)

    def fetch(self, owner: str, refs: list[str]) -> dict[str, bytes]:
        """The pieces, from the local LRU or Redis (one round trip for the rest); BlobError if one is gone."""
        out: dict[str, bytes] = {}
        wanted = []
        for ref in dict.fromkeys(refs):
            data = self.cache.get((owner, ref))
            if data is None:
                wanted.append(ref)
            else:
                out[ref] = data
        if wanted:
            pipe = self.redis.pipeline()
            for ref in wanted:
                key = keys.blob_key(self.prefix, owner, ref)
                pipe.get(key)
                pipe.expire(key, self.ttl_s)
            # A use keeps the pieces' place in the LRU and the budget's index alive with them, as check does.
            index = keys.blob_index_key(self.prefix, owner)
            pipe.zadd(index, dict.fromkeys(wanted, time.time()), xx=True)
            pipe.expire(index, self.ttl_s)
            pipe.expire(keys.blob_sizes_key(self.prefix, owner), self.ttl_s)
            values = pipe.execute()[:-3][0::2]
            lost = [r for r, v in zip(wanted, values) if v is None]
            if lost:
                raise BlobError("tensor_not_found", f"{len(lost)} tensor piece(s) went away before the job ran "
                                f"(expired or evicted): {', '.join(r[:12] for r in lost[:4])}; upload them again",
                                refs=lost[:64])
            for ref, data in zip(wanted, values):
                out[ref] = data
                self.cache.put((owner, ref), data)
        return out

    def resolved(self, owner: str, req: GradientRequest, held: set[str] | frozenset = frozenset()) -> GradientRequest:
        """The request with every referenced tensor's bytes in place (a worker, before the engine), whatever
        data the body gave beside the refs (the API refuses both): a tensor's refs then name its data's bytes.
        `held`: names of model.weights the worker's engine has in place already (Engine.in_place): their bytes
        are not fetched, and they stay refs alone (the engine knows them by their refs)."""
        if not has_refs(req):
            return req
        import msgspec

        skipped = {id(v) for k, v in (req.model.weights or {}).items() if k in held}
        pieces = self.fetch(owner, [r for _, v in request_tensors(req) if id(v) not in skipped
                                    for r in (refs_of(v) or [])])

        def fill(value: Any) -> Any:
            refs = refs_of(value)
            if refs is None or id(value) in skipped:
                return value
            t = value if isinstance(value, Tensor) else msgspec.convert(value, Tensor)
            data = pieces[refs[0]] if len(refs) == 1 else b"".join(pieces[r] for r in refs)
            # The refs stay: they now name what `data` holds (the engine's resident models key on them)
            return Tensor(dtype=t.dtype, shape=t.shape, data=data, refs=refs)

        def fill_each(value: Any) -> Any:
            if _is_tensor(value):
                return fill(value)
            if isinstance(value, dict):
                return {k: fill(v) if _is_tensor(v) else v for k, v in value.items()}
            if isinstance(value, list) and value and all(_is_tensor(v) for v in value):
                return [fill(v) for v in value]
            return value

        model = req.model
        if model.weights:
            model = msgspec.structs.replace(model, weights={k: fill(v) for k, v in model.weights.items()})
        options = req.options
        if options.hvp is not None and isinstance(options.hvp.vector, dict):
            options = msgspec.structs.replace(options, hvp=msgspec.structs.replace(
                options.hvp, vector={k: fill(v) for k, v in options.hvp.vector.items()}))
        return msgspec.structs.replace(req, model=model, inputs=fill_each(req.inputs),
                                       targets=fill_each(req.targets), options=options)
