"""What a request sends, parsed and checked: the body as a GradientRequest (JSON or MessagePack), the
`wait` query parameter, and the Idempotency-Key, Idempotency-Key-Age and Gradsvc-Release-Results headers.
Each fault is a coded 4xx."""

from __future__ import annotations

import re
from typing import Any

import anyio.to_thread
import msgspec
from litestar import Request

from gradsvc.runtime.settings import Settings
from gradsvc.wire import MAX_RELEASED, RELEASE_HEADER, GradientRequest, Tensor

from .exceptions import ServiceError
from .messages import explain, integral_floats_as_ints
from .negotiation import body_format

_decoders = {"json": msgspec.json.Decoder(GradientRequest), "msgpack": msgspec.msgpack.Decoder(GradientRequest)}
# Past this size decoding a body takes milliseconds: it runs in a worker thread so the event loop keeps
# serving other requests (bench/medium_job.py).
_INLINE_BODY_BYTES = 1 << 20


async def read_request(request: Request) -> tuple[bytes, str, GradientRequest]:
    """(the bytes to queue, their format, the request)."""
    fmt = body_format(request)  # before reading: a wrong media type is refused without its body
    body = await request.body()
    if len(body) > _INLINE_BODY_BYTES:
        req, body = await anyio.to_thread.run_sync(_decode, body, fmt)
    else:
        req, body = _decode(body, fmt)
    check_seeds(req)
    return body, fmt, req


# torch.manual_seed's range: a seed outside it is refused here, not by the worker after the queue.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# Every seed a request carries (tests/service/test_submit.py walks the wire Structs against this list).
SEED_FIELDS = ("model.seed", "options.hvp.seed", "options.curvature.seed")


def check_seeds(req: GradientRequest) -> None:
    """The one check of every seed field, for POST /gradients and POST /estimate alike."""
    seeds = {"model.seed": req.model.seed}
    if req.options.hvp is not None:
        seeds["options.hvp.seed"] = req.options.hvp.seed
    if req.options.curvature is not None:
        seeds["options.curvature.seed"] = req.options.curvature.seed
    for where, seed in seeds.items():
        if not SEED_MIN <= seed <= SEED_MAX:
            raise ServiceError("bad_option", f"{where} is {seed}, outside the 64 bits torch.manual_seed takes "
                               f"({SEED_MIN} to {SEED_MAX}); send a seed in that range (torch.initial_seed() is one)",
                               option=where, value=str(seed))


# What MessagePack (the queue's and Redis's encoding) holds of an integer.
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
_NOT_WALKED = frozenset({"inputs", "targets"})  # tensors' numbers: each tensor's decode checks its own


def check_integers(value: Any, where: str = "") -> None:
    """Every integer of a decoded body's fields (its structs, lists and dicts; tensors aside) within the 64 bits
    MessagePack holds, else a 422 bad_option naming the field: before the queue, not a 500 where it is
    encoded."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, float, Tensor)):
        return
    if isinstance(value, int):
        if not INT_MIN <= value <= INT_MAX:
            raise ServiceError("bad_option", f"{where} is {value}, beyond 64 bits ({INT_MIN} to {INT_MAX}); send "
                               "an integer in that range", option=where, value=str(value))
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            if name not in _NOT_WALKED:
                check_integers(getattr(value, name), f"{where}.{name}" if where else name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_integers(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_integers(item, f"{where}.{key}")


def _decode(body: bytes, fmt: str) -> tuple[GradientRequest, bytes]:
    """The request and the bytes to queue: the body itself, or, when integer fields came as 2.0, the body
    re-encoded with them made ints, so the workers' strict decode reads what the API validated."""
    if not body:
        raise ServiceError("malformed_body", "the request body is empty; send the JSON object described at /schema")
    try:
        return _decoders[fmt].decode(body), body
    except msgspec.ValidationError as exc:
        fixed = with_integral_floats(body, fmt, exc)
        if fixed is not None:
            return fixed
        message, detail = explain(exc, GradientRequest)
        raise ServiceError("invalid_body", message, reason=str(exc), **detail) from None
    except msgspec.DecodeError as exc:
        raise ServiceError("malformed_body", f"the body is not valid {fmt}: {exc}; send one "
                           f"{'JSON object' if fmt == 'json' else 'MessagePack map'} as described in docs/api.md",
                           reason=str(exc)) from None
    except RecursionError:  # msgspec's decoder recurses per nesting level
        raise ServiceError("too_large", "the body nests too deep to decode; containers may nest at most "
                           "GRADSVC_MAX_DEPTH levels (GET /layers lists Sequential and Residual)") from None


def with_integral_floats(body: bytes, fmt: str, exc: msgspec.ValidationError,
                         kind: type = GradientRequest) -> tuple[Any, bytes] | None:
    """The request (a `kind`) and its re-encoded body when its only fault was integer fields written as 2.0 (valid
    JSON Schema integers); runs only after the typed decode failed, so a well-formed body is decoded once."""
    codec = msgspec.json if fmt == "json" else msgspec.msgpack
    try:
        raw = codec.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    for _ in range(16):
        raw = integral_floats_as_ints(raw, exc)
        if raw is None:
            return None
        try:
            return msgspec.convert(raw, kind), codec.encode(raw)
        except msgspec.ValidationError as again:
            exc = again
    return None


def wait_s(request: Request, settings: Settings) -> float:
    """`wait` read as the schema states it: one number >= 0 (above GRADSVC_MAX_WAIT_S clamped), else a 400.
    Parsed here rather than by Litestar, which reads `wait=null` as absent and takes the last of several."""
    given = request.query_params.getall("wait", [])
    if not given:
        return settings.default_wait_s
    try:
        wait = float(given[0]) if len(given) == 1 else float("nan")
    except ValueError:
        wait = float("nan")
    if not 0 <= wait < float("inf"):
        shown = given[0] if len(given) == 1 else "&".join(f"wait={g}" for g in given)
        raise ServiceError("invalid_parameter", wait_message(shown, settings.max_wait_s), parameter="wait",
                           value=shown)
    return min(wait, settings.max_wait_s)


def wait_message(given: str | None, max_wait_s: float) -> str:
    return (f"query parameter `wait`: expected one number of seconds from 0 to {max_wait_s:g} (GRADSVC_MAX_WAIT_S; "
            f"larger values are clamped), got {given!r}; wait=0 answers 202 at once")


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not (1 <= len(key) <= 255) or not key.isascii() or not key.isprintable():
        raise ServiceError("bad_request", "the Idempotency-Key header must be 1 to 255 printable ASCII characters "
                           f"(got {len(key)} characters); send one random key (a UUID) per request",
                           header="Idempotency-Key")
    return key


def key_age_s(request: Request) -> float | None:
    """Idempotency-Key-Age: the SDK's retry of a POST says how many seconds ago it first sent its key."""
    raw = request.headers.get("idempotency-key-age")
    if raw is None:
        return None
    try:
        age = float(raw)
    except ValueError:
        age = float("nan")
    if not 0 <= age < 1e9:
        raise ServiceError("bad_request", f"the Idempotency-Key-Age header must be the seconds since the key was "
                           f"first sent (a number >= 0), got {raw[:40]!r}", header="Idempotency-Key-Age")
    return age


_JOB_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def released_results(request: Request) -> list[str]:
    """Gradsvc-Release-Results: the ids (comma-separated, at most MAX_RELEASED) of this key's finished jobs
    whose results the client holds and the service may drop now rather than keep GRADSVC_RESULT_TTL_S."""
    raw = request.headers.get(RELEASE_HEADER.lower())
    if raw is None:
        return []
    ids = [part.strip() for part in raw.split(",") if part.strip()]
    bad = next((i for i in ids if not _JOB_ID.fullmatch(i)), None)
    if bad is not None or len(ids) > MAX_RELEASED:
        what = f"{bad[:60]!r} is not a job id" if bad is not None else f"it names {len(ids)} jobs"
        raise ServiceError("bad_request", f"the {RELEASE_HEADER} header must list up to {MAX_RELEASED} job ids "
                           f"(as POST /gradients returned them), comma-separated; {what}", header=RELEASE_HEADER)
    return list(dict.fromkeys(ids))
