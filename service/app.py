"""The Litestar app factory: builds the API's parts from the settings once and wires them into the route
handlers (service/*_routes.py, pages.py, docs.py): the parts as app state (service/api_state.py), the
caller (`owner`, `viewer`) as dependencies. Routes raise; service/error_responses.py
renders every error."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import anyio.to_thread
import msgspec
from litestar import Litestar
from litestar.di import Provide

from gradsvc.broker.blobs import BlobStore
from gradsvc.broker.connection import sync_redis
from gradsvc.broker.graphs import GraphStore
from gradsvc.broker.runs import RunBounds, RunStore
from gradsvc.engine import Engine, config_from_settings, layer_catalogue, warm_up_shape_check
from gradsvc.runtime.malloc import keep_large_buffers
from gradsvc.runtime.settings import Settings
from gradsvc.wire import LayerInfo

from . import docs, gradient_routes, job_routes, openapi, pages, probe_routes, run_routes, tensor_routes
from .api_metrics import ApiMetrics
from .api_state import ApiState
from .auth import Auth
from .enqueue import Enqueuer
from .error_responses import handle_exception
from .http_server import BodyBudget
from .idempotency import DIGEST_THREADS, IdempotencyClaims
from .job_reader import JobReader
from .queues import JobRecord, Queues
from .page_login import PageLogin
from .submission import Submitter

log = logging.getLogger("gradsvc.api")
HANDOFF_SWEEP_S = 60.0
PIECE_SEND_S = 32.0
ROUTES = [*gradient_routes.ROUTES, *job_routes.ROUTES, *probe_routes.ROUTES, *tensor_routes.ROUTES, *docs.ROUTES,
          *pages.ROUTES, *run_routes.ROUTES]


@dataclass(frozen=True)
class JobParts:
    """The API's side of the queue, built from the settings: create_app wires them into the routes; a test or
    a bench uses them without HTTP."""

    queues: Queues
    enqueuer: Enqueuer
    reader: JobReader


def job_parts(settings: Settings, digests: Executor | None = None) -> JobParts:
    """`digests`: the threads a large body's Idempotency-Key digest runs on (None: on the enqueue's own)."""
    queues = Queues(settings)
    claims = IdempotencyClaims(queues.redis, queues.epochs, settings.queue_prefix, settings.idempotency_ttl_s)
    enqueuer = Enqueuer(queues, claims, JobRecord.from_settings(settings), settings.min_shard_rows, digests=digests)
    return JobParts(queues, enqueuer,
                    JobReader(queues, heartbeat_s=settings.worker_heartbeat_s,
                              redis_timeout_s=settings.redis_timeout_s, job_timeout_s=settings.job_timeout_s))


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or Settings.from_env()
    # The app's own threads for Idempotency-Key digests of large bodies, shut down with the app.
    digests = ThreadPoolExecutor(max_workers=DIGEST_THREADS, thread_name_prefix="gradsvc-digest")
    jobs = job_parts(settings, digests)
    queues, enqueuer, reader = jobs.queues, jobs.enqueuer, jobs.reader
    auth = Auth(settings, queues.redis)
    graphs = GraphStore(queues.redis, settings.queue_prefix, settings.graph_ttl_s)
    # A piece is up to 32 MiB, and its SET took over GRADSVC_REDIS_TIMEOUT_S (sized for small commands: a hung
    # Redis answers 503 within it) on this loaded 2-core host while GPT-2 small went up: pieces get a
    # connection of their own whose timeout covers sending one at 1 MB/s.
    piece_redis = sync_redis(settings.redis_url, socket_connect_timeout=settings.redis_timeout_s,
                             socket_timeout=settings.redis_timeout_s + PIECE_SEND_S)
    blobs = BlobStore(piece_redis, settings.queue_prefix, settings.tensor_ttl_s, settings.tensor_budget_bytes,
                      max_refs=settings.max_refs)
    engine = Engine(config_from_settings(settings))  # its caches serve every request of this app
    page_login = PageLogin(auth, queues.aredis, settings.queue_prefix, settings.login_failures_per_minute)
    runs = RunStore(queues.redis, settings.queue_prefix, RunBounds.from_settings(settings))
    metrics = ApiMetrics(reader, runs, settings)
    schema_doc = msgspec.json.encode(openapi.build(settings.max_wait_s, keys_required=auth.enabled,
                                                   metrics_require_key=settings.metrics_require_key))
    parts = {"settings": settings, "engine": engine, "auth": auth, "graphs": graphs, "blobs": blobs,
             "submitter": Submitter(engine, graphs, blobs, auth, enqueuer, reader, metrics, runs), "reader": reader,
             "metrics": metrics,
             "page_login": page_login, "schema_doc": schema_doc, "runs": runs,
             "layers": [msgspec.convert(x, LayerInfo) for x in layer_catalogue()]}

    @asynccontextmanager
    async def lifespan(app: Litestar):
        exposure = settings.exposure_warning()
        if exposure:
            log.warning(exposure)
        sweeper = None
        if queues.handoff is not None:
            sweeper = asyncio.get_running_loop().create_task(_sweep_handoff(queues, settings))
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            await queues.close()

    app = Litestar(
        route_handlers=ROUTES,
        dependencies={"owner": Provide(auth.owner, sync_to_thread=False), "viewer": Provide(page_login.owner)},
        state=ApiState(parts),
        exception_handlers={Exception: handle_exception},
        lifespan=[lifespan],
        on_shutdown=[lambda: digests.shutdown(cancel_futures=True)],
        middleware=[metrics.middleware, BodyBudget(settings.max_bodies_bytes).middleware],
        openapi_config=None,
        request_max_body_size=settings.max_body_bytes,
        debug=False,
    )
    return app


async def _sweep_handoff(queues: Queues, settings: Settings) -> None:
    """Once a minute: handoff files past their TTL go (the workers sweep too, after their jobs)."""
    while True:
        try:
            await anyio.to_thread.run_sync(queues.sweep_handoff, settings.result_ttl_s, settings.failure_ttl_s)
        except OSError as exc:
            log.warning("handoff sweep of %s failed: %s", settings.handoff_dir, exc)
        await anyio.sleep(HANDOFF_SWEEP_S)


def app_factory() -> Litestar:
    """uvicorn entry (`--factory`): settings from the environment."""
    import torch

    # The API's tensor work (validation on meta, finiteness checks) is small: one thread. With torch's default
    # (all cores) its OpenMP threads wait on cores the workers hold: 6 ms -> 12-88 ms per 2 MB request here.
    torch.set_num_threads(1)
    keep_large_buffers(one_arena=True)
    warm_up_shape_check()  # else the first request's validation pays seconds for torch's meta kernels
    return create_app(Settings.from_env())
