"""Tensors by reference: PUT /tensors/{sha256} stores one piece for this API key, POST /tensors/missing says
which of a request's pieces the key still has to upload."""

from __future__ import annotations

import anyio.to_thread
import msgspec
from litestar import Request, Response, post, put

from gradsvc.broker import blobs as tensor_refs

from .api_state import ApiState
from .exceptions import ServiceError
from .negotiation import body_format, respond


class _MissingRefs(msgspec.Struct, forbid_unknown_fields=True):
    refs: list[str] = []


@put("/tensors/{ref:str}", status_code=201)
async def upload_tensor(request: Request, owner: str, state: ApiState, ref: str) -> Response:
    """One piece of tensor bytes, stored under its sha256 for this API key (GRADSVC_TENSOR_TTL_S, within
    GRADSVC_TENSOR_BUDGET_BYTES); a request's tensors then name it in `refs`."""
    if not tensor_refs.DIGEST.fullmatch(ref):
        raise ServiceError("invalid_parameter", f"/tensors/{ref[:80]}: the path names a piece by its sha256, 64 "
                           "lowercase hex digits", parameter="ref")
    data = await request.body()
    blobs, metrics = state.blobs, state.metrics

    def store_piece() -> int:
        got = tensor_refs.digest(data)
        if got != ref:
            raise ServiceError("bad_tensor", f"the body's sha256 is {got}, not the {ref} the path names; send "
                               "the piece's raw bytes under their own digest", expected=ref, got=got)
        evicted = blobs.put(owner, ref, data)
        metrics.tensor_uploads.inc()
        metrics.tensor_upload_bytes.inc(len(data))
        metrics.tensor_evictions.inc(evicted)
        return evicted

    evicted = await anyio.to_thread.run_sync(store_piece)
    return respond(request, {"ref": ref, "bytes": len(data), "evicted": evicted}, status=201)


@post("/tensors/missing", status_code=200)
async def missing_tensors(request: Request, owner: str, state: ApiState) -> Response:
    """Which of `refs` this API key has not uploaded (or whose pieces expired or were evicted)."""
    body = await request.body()
    try:
        asked = msgspec.json.decode(body, type=_MissingRefs) if body_format(request) == "json" else \
            msgspec.msgpack.decode(body, type=_MissingRefs)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ServiceError("invalid_body", f'the body is {{"refs": [sha256, ...]}}: {exc}') from None
    refs = [r for r in asked.refs if tensor_refs.DIGEST.fullmatch(r)][:100_000]
    missing = await anyio.to_thread.run_sync(lambda: state.blobs.missing(owner, refs))
    return respond(request, {"missing": missing})


ROUTES = [upload_tensor, missing_tensors]
