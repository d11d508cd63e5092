"""What the service says about itself: /healthz and /readyz (probes, no API key; ready: Redis reachable and
taking writes, a worker alive), /metrics (Prometheus), /schema (the OpenAPI document), /layers (the layer
table), and / (a browser sent to the docs)."""

from __future__ import annotations

import anyio.to_thread
from litestar import Request, Response, get
from litestar.response import Redirect
from prometheus_client import CONTENT_TYPE_LATEST

from .api_metrics import EVERY_OWNER
from .api_state import ApiState
from .exceptions import ServiceError
from .negotiation import respond


@get("/layers")
async def list_layers(request: Request, owner: str, state: ApiState) -> Response:
    return respond(request, state.layers)


@get("/healthz")
async def healthz(request: Request) -> Response:
    return respond(request, {"status": "ok"})


@get("/readyz")
async def readyz(request: Request, state: ApiState) -> Response:  # a probe: no API key, as /healthz
    reader = state.reader

    def check() -> int:
        reader.ping()
        reader.probe_write()  # a Redis that answers but refuses writes is not ready: 503 with its code
        reader.epochs.refresh()  # Redis restarted empty: a new epoch, and ids of the old one read as lost
        return len(reader.workers())

    n = await anyio.to_thread.run_sync(check)
    if n == 0:
        raise ServiceError("not_ready", "Redis is reachable but no worker is alive; start `gradsvc worker`")
    return respond(request, {"status": "ready", "workers": n})


@get("/metrics")
async def metrics_route(request: Request, state: ApiState) -> Response:
    settings, auth = state.settings, state.auth
    if settings.metrics_require_key:  # open by default, as Prometheus scrapes expect
        auth.owner(request)
    text = await anyio.to_thread.run_sync(state.metrics.exposition, _runs_shown(request, state))
    return Response(text, media_type=CONTENT_TYPE_LATEST)


def _runs_shown(request: Request, state: ApiState) -> str | None:
    """Whose runs a scrape sees: every run without API keys or with GRADSVC_RUN_METRICS_PUBLIC; else the runs of
    the key it sends, and none without one (run names, losses and norms are the key holders' data)."""
    if not state.auth.enabled or state.settings.run_metrics_public:
        return EVERY_OWNER
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return state.auth.owner_of_key(token.strip()) if scheme.lower() == "bearer" and token.strip() else None


@get("/schema")
async def schema(request: Request, viewer: str | None, state: ApiState) -> Response:
    if state.settings.docs_require_key and viewer is None:  # the Bearer key, or a browser's session on /docs
        state.auth.owner(request)  # raises the 401 that names the header
    return Response(state.schema_doc, media_type="application/json")


@get("/", include_in_schema=False)
async def root() -> Redirect:
    # A browser pointed at the service's address lands on its interactive docs, which link the job pages.
    return Redirect("/docs", status_code=307)


ROUTES = [list_layers, healthz, readyz, metrics_route, schema, root]
