"""The API's parts as Litestar's app state: built once by create_app, handed to a handler that declares
`state: ApiState`. App state rather than one `Provide` per part: Litestar resolves the dependencies of one
level in an anyio task group, a task each, as soon as there are two, which cost POST /gradients ~680 calls
per request more and GET /jobs/{id} ~340, against one dependency each before; the per-request `owner` and
`viewer` stay dependencies."""

from __future__ import annotations

from litestar.datastructures import State

from gradsvc.broker.blobs import BlobStore
from gradsvc.broker.graphs import GraphStore
from gradsvc.broker.runs import RunStore
from gradsvc.engine import Engine
from gradsvc.runtime.settings import Settings
from gradsvc.wire import LayerInfo

from .api_metrics import ApiMetrics
from .auth import Auth
from .job_reader import JobReader
from .page_login import PageLogin
from .submission import Submitter


class ApiState(State):
    settings: Settings
    engine: Engine  # the validation side of the engine, its caches shared by every request
    auth: Auth
    graphs: GraphStore
    blobs: BlobStore
    submitter: Submitter
    reader: JobReader
    metrics: ApiMetrics
    page_login: PageLogin
    schema_doc: bytes  # GET /schema's answer, encoded once
    layers: list[LayerInfo]  # GET /layers's answer
    runs: RunStore  # training runs: GET/DELETE /runs, the run pages, the run gauges of /metrics
