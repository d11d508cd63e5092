"""The Litestar app factory and its routes. Routes raise; service.errors renders every error."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import anyio.to_thread
import msgspec
from litestar import Litestar, Request, Response, delete, get, post, put, route
from litestar.di import Provide
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gradsvc.broker import blobs as tensor_refs
from gradsvc.broker.blobs import BlobError, BlobStore
from gradsvc.broker.connection import sync_redis
from gradsvc.broker.graphs import GraphStore
from gradsvc.runtime.malloc import keep_large_buffers
from gradsvc.runtime.settings import Settings
from gradsvc.wire import GradientRequest, JobAccepted, LayerInfo
from workers.engine import config_from_settings, estimate, layer_catalogue, prepare, warm_up_shape_check
from workers.engine.prepare import Prepared

from . import docs, openapi, pages
from .auth import Auth
from .encoding import MSGPACK, body_format, respond, wants_msgpack
from .errors import ServiceError, error_response, handle_exception, wait_message
from .jobs import JobStore
from .messages import explain, integral_floats_as_ints
from .metrics import ApiMetrics
from .sessions import Sessions

log = logging.getLogger("gradsvc.api")
_decoders = {"json": msgspec.json.Decoder(GradientRequest), "msgpack": msgspec.msgpack.Decoder(GradientRequest)}
# Past these sizes decoding a body or encoding a result takes milliseconds: it runs in a worker thread so
# the event loop keeps serving other requests (bench/medium_job.py).
_INLINE_BODY_BYTES = 1 << 20
_INLINE_RESULT_PARAMETERS = 1 << 16
HANDOFF_SWEEP_S = 60.0


def _decode(body: bytes, fmt: str) -> tuple[GradientRequest, bytes]:
    """The request and the bytes to queue: the body itself, or, when integer fields came as 2.0, the body
    re-encoded with them made ints, so the workers' strict decode reads what the API validated."""
    if not body:
        raise ServiceError("malformed_body", "the request body is empty; send the JSON object described at /schema")
    try:
        return _decoders[fmt].decode(body), body
    except msgspec.ValidationError as exc:
        fixed = _with_integral_floats(body, fmt, exc)
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


# A body this small with a layer spec is validated on the event loop (a spec seen before: ~0.1 ms; a new
# one: a few ms, once), sparing the thread hop (bench/summary.py's small job).
_EVENT_LOOP_BODY_BYTES = 16 << 10


def _small_layer_spec(req: GradientRequest, body: bytes) -> bool:
    """A body small enough to check on the event loop, of a layer spec (a graph may need a Redis look-up),
    with no tensor by reference (its pieces are looked up in Redis)."""
    return len(body) <= _EVENT_LOOP_BODY_BYTES and req.model.layers is not None and not tensor_refs.has_refs(req)


class _MissingRefs(msgspec.Struct, forbid_unknown_fields=True):
    refs: list[str] = []


def _check_refs(pieces: BlobStore, owner: str, req: GradientRequest) -> None:
    try:
        pieces.check(owner, req)
    except BlobError as exc:
        raise ServiceError(exc.code, exc.message, **exc.detail) from None


def _inline(req: GradientRequest, body: bytes, key: str | None, auth: Auth) -> bool:
    """Whether a request can be checked and enqueued without a thread: a small layer spec, the shared queue
    (a device queue checks for live workers), one shard, no Idempotency-Key (a claim to make first) and no
    rate limit (a counter to bump)."""
    return (_small_layer_spec(req, body) and req.options.device == "auto" and req.options.shards == 1
            and key is None and auth.limit <= 0)


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not (1 <= len(key) <= 255) or not key.isascii() or not key.isprintable():
        raise ServiceError("bad_request", "the Idempotency-Key header must be 1 to 255 printable ASCII characters "
                           f"(got {len(key)} characters); send one random key (a UUID) per request",
                           header="Idempotency-Key")
    return key


def _key_age_s(request: Request) -> float | None:
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


def _with_integral_floats(body: bytes, fmt: str,
                          exc: msgspec.ValidationError) -> tuple[GradientRequest, bytes] | None:
    """The request and its re-encoded body when its only fault was integer fields written as 2.0 (valid JSON
    Schema integers); runs only after the typed decode failed, so a well-formed body is decoded once."""
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
            return msgspec.convert(raw, GradientRequest), codec.encode(raw)
        except msgspec.ValidationError as again:
            exc = again
    return None


PIECE_SEND_S = 32.0


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or Settings.from_env()
    store = JobStore(settings)
    graphs = GraphStore(store.redis, settings.queue_prefix, settings.graph_ttl_s)
    # A piece is up to 32 MiB, and its SET took over GRADSVC_REDIS_TIMEOUT_S (sized for small commands: a hung
    # Redis answers 503 within it) on this loaded 2-core host while GPT-2 small went up: pieces get a
    # connection of their own whose timeout covers sending one at 1 MB/s.
    piece_redis = sync_redis(settings.redis_url, socket_connect_timeout=settings.redis_timeout_s,
                             socket_timeout=settings.redis_timeout_s + PIECE_SEND_S)
    pieces = BlobStore(piece_redis, settings.queue_prefix, settings.tensor_ttl_s, settings.tensor_budget_bytes)
    auth = Auth(settings, store.redis)
    metrics = ApiMetrics(store)
    config = config_from_settings(settings)
    sessions = Sessions(auth, store.aredis, settings.queue_prefix)
    schema_doc = msgspec.json.encode(openapi.build(settings.max_wait_s, keys_required=auth.enabled,
                                                   metrics_require_key=settings.metrics_require_key))
    layers = [msgspec.convert(x, LayerInfo) for x in layer_catalogue()]

    async def read_request(request: Request) -> tuple[bytes, str, GradientRequest]:
        """(the bytes to queue, their format, the request)."""
        fmt = body_format(request)  # before reading: a wrong media type is refused without its body
        body = await request.body()
        if len(body) > _INLINE_BODY_BYTES:
            req, body = await anyio.to_thread.run_sync(_decode, body, fmt)
        else:
            req, body = _decode(body, fmt)
        return body, fmt, req

    async def respond_job(request: Request, body, result, encoding: str = "auto") -> Response:
        if result is not None and result.parameter_count > _INLINE_RESULT_PARAMETERS:
            return await anyio.to_thread.run_sync(lambda: respond(request, body, encoding=encoding))
        return respond(request, body, encoding=encoding)

    def wait_s(request: Request) -> float:
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

    def enqueue_in_thread(req: GradientRequest, body: bytes, fmt: str, owner: str, key: str | None,
                          prep: Prepared | None = None, key_age_s: float | None = None) -> tuple[str, bool]:
        """Validation and enqueue in one thread hop. Validation on the meta device: an invalid spec never
        reaches the queue. A graph_ref is looked up among this owner's graphs (and its TTL refreshed) here;
        a graph sent whole is kept under its ref, for this owner, for the next request. `prep`: the request
        already validated on the event loop."""
        if prep is None:
            _check_refs(pieces, owner, req)
            prep = prepare(req, config, "meta", graphs=graphs.resolver(owner))
        auth.check_rate(owner)
        if prep.graph_data is not None:
            graphs.put(owner, prep.graph.ref, req.model.graph, prep.graph_data)
        sharded = (req, prep) if req.options.shards != 1 else None
        return store.enqueue(body, fmt, req.options.device, owner, key, sharded=sharded,
                             result_bytes=prep.gradient_bytes, key_age_s=key_age_s)

    @post("/gradients", status_code=200)
    async def submit_gradients(request: Request, owner: str) -> Response:
        wait = wait_s(request)
        body, fmt, req = await read_request(request)
        key = _idempotency_key(request)
        key_age_s = _key_age_s(request) if key is not None else None
        prep = prepare(req, config, "meta") if _inline(req, body, key, auth) else None
        if prep is not None and not store.large_result(prep.gradient_bytes):
            # A small layer-spec request that needs nothing else of Redis: checked on the event loop (a
            # spec seen before costs ~0.1 ms) and enqueued over the async connection, with no thread hop.
            job_id, created = await store.enqueue_async(body, fmt, owner), True
        else:
            job_id, created = await anyio.to_thread.run_sync(lambda: enqueue_in_thread(req, body, fmt, owner, key,
                                                                                        prep, key_age_s))
        if created:
            metrics.jobs_submitted.inc()
        ended, raw = await store.wait(job_id, wait)
        if ended and raw is not None:  # finished
            if wants_msgpack(request):  # the stored MessagePack is the answer: no decode, no copy
                return Response(raw, media_type=MSGPACK)
            result = store.decode_result(raw)
            return await respond_job(request, result, result, encoding=req.options.encoding)
        # Failed, or still running: the answer is what GET /jobs/{id} says now (it may have ended meanwhile).
        info = await store.info(job_id, owner)
        if info.status == "finished":
            return await respond_job(request, info.result, info.result, encoding=req.options.encoding)
        if info.error is not None:
            return error_response(request, info.error.code, info.error.message, info.error.detail,
                                  job_id=job_id, status=info.status)
        return respond(request, JobAccepted(job_id=job_id, status=info.status, progress=info.progress), status=202,
                       headers={"Location": f"/jobs/{job_id}"})

    @post("/estimate", status_code=200)
    async def estimate_memory(request: Request, owner: str) -> Response:
        body, _, req = await read_request(request)
        if _small_layer_spec(req, body):
            result = estimate(req, config)  # as for POST /gradients: a spec seen before is a look-up (~0.1 ms)
        else:
            def checked_estimate():
                _check_refs(pieces, owner, req)
                return estimate(req, config, graphs=graphs.resolver(owner))

            result = await anyio.to_thread.run_sync(checked_estimate)
        return respond(request, result)

    @put("/tensors/{ref:str}", status_code=201)
    async def upload_tensor(request: Request, owner: str, ref: str) -> Response:
        """One piece of tensor bytes, stored under its sha256 for this API key (GRADSVC_TENSOR_TTL_S, within
        GRADSVC_TENSOR_BUDGET_BYTES); a request's tensors then name it in `refs`."""
        if not tensor_refs.DIGEST.fullmatch(ref):
            raise ServiceError("invalid_parameter", f"/tensors/{ref[:80]}: the path names a piece by its sha256, 64 "
                               "lowercase hex digits", parameter="ref")
        data = await request.body()

        def store_piece() -> int:
            got = tensor_refs.digest(data)
            if got != ref:
                raise ServiceError("bad_tensor", f"the body's sha256 is {got}, not the {ref} the path names; send "
                                   "the piece's raw bytes under their own digest", expected=ref, got=got)
            try:
                evicted = pieces.put(owner, ref, data)
            except BlobError as exc:
                raise ServiceError(exc.code, exc.message, **exc.detail) from None
            metrics.tensor_uploads.inc()
            metrics.tensor_upload_bytes.inc(len(data))
            metrics.tensor_evictions.inc(evicted)
            return evicted

        evicted = await anyio.to_thread.run_sync(store_piece)
        return respond(request, {"ref": ref, "bytes": len(data), "evicted": evicted}, status=201)

    @post("/tensors/missing", status_code=200)
    async def missing_tensors(request: Request, owner: str) -> Response:
        """Which of `refs` this API key has not uploaded (or whose pieces expired or were evicted)."""
        body = await request.body()
        try:
            asked = msgspec.json.decode(body, type=_MissingRefs) if body_format(request) == "json" else \
                msgspec.msgpack.decode(body, type=_MissingRefs)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ServiceError("invalid_body", f'the body is {{"refs": [sha256, ...]}}: {exc}') from None
        refs = [r for r in asked.refs if tensor_refs.DIGEST.fullmatch(r)][:100_000]
        missing = await anyio.to_thread.run_sync(lambda: pieces.missing(owner, refs))
        return respond(request, {"missing": missing})

    @route("/jobs/{job_id:str}", http_method=["OPTIONS"], include_in_schema=False)
    async def job_options() -> Response:
        # Litestar's automatic OPTIONS answer for a path served by two handlers lists only the first one's
        # methods ("GET, OPTIONS"); registered first, this one replaces it.
        return Response(None, status_code=204, headers={"Allow": "DELETE, GET, OPTIONS"})

    @get("/jobs/{job_id:str}")
    async def get_job(request: Request, owner: str, job_id: str) -> Response:
        info = await store.info(job_id, owner)
        return await respond_job(request, info, info.result)

    @delete("/jobs/{job_id:str}", status_code=200)
    async def cancel_job(request: Request, owner: str, job_id: str) -> Response:
        await store.info(job_id, owner, with_result=False)  # 404 unless it is this key's job
        await anyio.to_thread.run_sync(store.cancel, job_id)
        return respond(request, await store.info(job_id, owner))

    @get("/layers")
    async def list_layers(request: Request, owner: str) -> Response:
        return respond(request, layers)

    @get("/healthz")
    async def healthz(request: Request) -> Response:
        return respond(request, {"status": "ok"})

    @get("/readyz")
    async def readyz(request: Request) -> Response:  # a probe: no API key, as /healthz
        def check() -> int:
            store.ping()
            store.epochs.refresh()  # Redis restarted empty: a new epoch, and ids of the old one read as lost
            return len(store.workers())

        n = await anyio.to_thread.run_sync(check)
        if n == 0:
            raise ServiceError("not_ready", "Redis is reachable but no worker is alive; start `gradsvc worker`")
        return respond(request, {"status": "ready", "workers": n})

    @get("/metrics")
    async def metrics_route(request: Request) -> Response:
        if settings.metrics_require_key:  # open by default, as Prometheus scrapes expect
            auth.owner(request)
        text = await anyio.to_thread.run_sync(generate_latest, metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @get("/schema")
    async def schema(request: Request, viewer: str | None) -> Response:
        if viewer is None:  # the Bearer key, or the session cookie of a browser on /docs
            auth.owner(request)  # raises the 401 that names the header
        return Response(schema_doc, media_type="application/json")

    @asynccontextmanager
    async def lifespan(app: Litestar):
        exposure = settings.exposure_warning()
        if exposure:
            log.warning(exposure)
        sweeper = asyncio.get_running_loop().create_task(sweep_handoff()) if store.handoff is not None else None
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            await store.close()

    async def sweep_handoff() -> None:
        """Once a minute: handoff files past their TTL go (the workers sweep too, after their jobs)."""
        while True:
            try:
                await anyio.to_thread.run_sync(store.sweep_handoff)
            except OSError as exc:
                log.warning("handoff sweep of %s failed: %s", settings.handoff_dir, exc)
            await anyio.sleep(HANDOFF_SWEEP_S)

    app = Litestar(
        route_handlers=[submit_gradients, estimate_memory, job_options, get_job, cancel_job, list_layers, healthz,
                        readyz, metrics_route, schema, upload_tensor, missing_tensors, *docs.ROUTES,
                        *pages.ROUTES],
        dependencies={"owner": Provide(auth.owner, sync_to_thread=False), "viewer": Provide(sessions.owner),
                      "store": Provide(lambda: store, sync_to_thread=False),
                      "sessions": Provide(lambda: sessions, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        lifespan=[lifespan],
        middleware=[metrics.middleware],
        openapi_config=None,
        request_max_body_size=settings.max_body_bytes,
        debug=False,
    )
    app.state.settings = settings
    app.state.store = store
    return app


def app_factory() -> Litestar:
    """uvicorn entry (`--factory`): settings from the environment."""
    import torch

    # The API's tensor work (validation on meta, finiteness checks) is small: one thread. With torch's default
    # (all cores) its OpenMP threads wait on cores the workers hold: 6 ms -> 12-88 ms per 2 MB request here.
    torch.set_num_threads(1)
    keep_large_buffers(one_arena=True)
    warm_up_shape_check()  # else the first request's validation pays seconds for torch's meta kernels
    return create_app(Settings.from_env())
