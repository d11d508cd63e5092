"""Content negotiation: JSON (curl) or MessagePack (the SDK), and how result tensors are written in JSON."""

from __future__ import annotations

import mmap
from typing import Any

import anyio.to_thread
import msgspec
from litestar import Request, Response

from gradsvc.engine import tensors
from gradsvc.wire import GradientResult, PerSample, Tensor, is_tensor, raw_data

from .exceptions import ServiceError

MSGPACK = "application/msgpack"
JSON = "application/json"
LIST_MAX_ELEMENTS = 65_536  # `encoding: auto` writes larger tensors as base64 in JSON
# Past this size encoding a result takes milliseconds: it runs in a worker thread so the event loop keeps
# serving other requests (bench/medium_job.py).
_INLINE_RESULT_PARAMETERS = 1 << 16

_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()


class Encoded(Response):
    """A response whose content is already encoded, in any buffer (a result's mapped handoff file): sent as
    it is, where Response would encode what is not bytes."""

    def render(self, content: Any, media_type: str, *args: Any, **kwargs: Any) -> Any:
        if isinstance(content, (bytes, memoryview, mmap.mmap)):
            return content
        return super().render(content, media_type, *args, **kwargs)


def wants_msgpack(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return MSGPACK in accept or "application/x-msgpack" in accept


def body_format(request: Request) -> str:
    """"json" or "msgpack" from Content-Type (none: JSON); any other media type is a 415."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype in (MSGPACK, "application/x-msgpack"):
        return "msgpack"
    if ctype in ("", JSON) or (ctype.startswith("application/") and ctype.endswith("+json")):
        return "json"
    raise ServiceError("unsupported_media_type", f"Content-Type {ctype!r} is not accepted; send the body as "
                       f"{JSON} (curl: -H 'Content-Type: {JSON}') or {MSGPACK}", content_type=ctype,
                       accepted=[JSON, MSGPACK])


def respond(request: Request, body: Any, *, status: int = 200, headers: dict[str, str] | None = None,
            encoding: str = "auto") -> Response:
    if wants_msgpack(request):
        return Response(_msgpack.encode(body), status_code=status, media_type=MSGPACK, headers=headers)
    return Response(_json.encode(for_json(body, encoding)), status_code=status, media_type=JSON, headers=headers)


async def respond_job(request: Request, body: Any, result: GradientResult | None, encoding: str = "auto") -> Response:
    """respond() of a job's view or result: encoded in a thread when `result` is large."""
    if result is not None and result.parameter_count > _INLINE_RESULT_PARAMETERS:
        return await anyio.to_thread.run_sync(lambda: respond(request, body, encoding=encoding))
    return respond(request, body, encoding=encoding)


def for_json(value: Any, encoding: str) -> Any:
    """Rewrites raw-byte tensors inside a result as nested lists or base64, as `encoding` asks."""
    if isinstance(value, GradientResult):
        return _result_for_json(value, encoding)
    if hasattr(value, "result") and isinstance(getattr(value, "result"), GradientResult):
        return msgspec.structs.replace(value, result=_result_for_json(value.result, encoding))
    return value


def _tensor(t: Tensor | None, encoding: str) -> Tensor | None:
    if t is None or raw_data(t) is None:
        return t
    listed = encoding == "list" or (encoding == "auto" and _numel(t) <= LIST_MAX_ELEMENTS)
    return tensors.to_listed(t) if listed else tensors.to_b64(t)


def _numel(t: Tensor) -> int:
    n = 1
    for s in t.shape:
        n *= s
    return n


def _tensors(d: dict | None, encoding: str) -> dict | None:
    return None if d is None else {k: _tensor(v, encoding) for k, v in d.items()}


def _result_for_json(r: GradientResult, encoding: str) -> GradientResult:
    return msgspec.structs.replace(
        r,
        gradients=_tensors(r.gradients, encoding),
        per_loss_gradients=None if r.per_loss_gradients is None else
        {k: _tensors(v, encoding) for k, v in r.per_loss_gradients.items()},
        input_gradient=_tensor(r.input_gradient, encoding),
        hvp=_tensors(r.hvp, encoding),
        per_sample=None if r.per_sample is None else PerSample(
            norms=_tensor(r.per_sample.norms, encoding), gradients=_tensors(r.per_sample.gradients, encoding)),
        buffers=_tensors(r.buffers, encoding),
        outputs=_tree(r.outputs, encoding),
        diagnostics=None if r.diagnostics is None else msgspec.structs.replace(
            r.diagnostics, variance=_tensors(r.diagnostics.variance, encoding),
            second_moment=_tensors(r.diagnostics.second_moment, encoding)),
        curvature=r.curvature if r.curvature is None or r.curvature.eigenvectors is None else msgspec.structs.replace(
            r.curvature, eigenvectors=[_tensors(v, encoding) for v in r.curvature.eigenvectors]),
    )


def _tree(value: Any, encoding: str) -> Any:
    """result.outputs (forward's structure of tensors) with each tensor rewritten as `encoding` asks."""
    if isinstance(value, Tensor):
        return _tensor(value, encoding)
    if is_tensor(value):
        return _tensor(msgspec.convert(value, Tensor), encoding)
    if isinstance(value, list):
        return [_tree(v, encoding) for v in value]
    if isinstance(value, dict):
        return {k: _tree(v, encoding) for k, v in value.items()}
    return value


def tensors_for_json(tensors_: dict | None, encoding: str) -> dict | None:
    """A map of raw-byte tensors (a session's gradients, weights, buffers) as `encoding` asks for JSON."""
    return _tensors(tensors_, encoding)


def tree_for_json(value: Any, encoding: str) -> Any:
    return _tree(value, encoding)
