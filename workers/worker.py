"""`gradsvc worker`: an RQ worker that runs jobs in its own process (no fork per job), so imported
torch and the CUDA context stay warm; it serves its Prometheus metrics on its own port."""

from __future__ import annotations

import logging
import os
import socket

import torch
from redis import Redis
from rq import Queue
from rq.worker import SimpleWorker

from gradsvc import keys
from gradsvc.settings import Settings

from .jobs import make_context, set_context
from .serializer import MsgpackSerializer

log = logging.getLogger("gradsvc.worker")


class GradientWorker(SimpleWorker):
    """SimpleWorker: a forking worker adds ~20 ms per job with torch loaded and cannot reuse a CUDA context."""


def _warm_up(device: torch.device) -> None:
    # The first matmul allocates BLAS/cuBLAS workspaces; pay that before the first job is timed.
    a = torch.randn(64, 64, device=device, requires_grad=True)
    (a @ a).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def redis_connection(settings: Settings) -> Redis:
    return Redis.from_url(settings.redis_url, socket_connect_timeout=settings.redis_timeout_s,
                          socket_timeout=max(settings.redis_timeout_s, 5.0), health_check_interval=10)


def build_worker(settings: Settings, *, index: int = 0) -> GradientWorker:
    ctx = make_context(settings)
    set_context(ctx)
    _warm_up(ctx.device)
    connection = redis_connection(settings)
    kind = ctx.device.type
    queues = [Queue(name, connection=connection, serializer=MsgpackSerializer)
              for name in keys.worker_queues(settings.queue_prefix, kind)]
    name = f"gradsvc-{kind}-{socket.gethostname()}-{os.getpid()}-{index}"
    return GradientWorker(queues, connection=connection, serializer=MsgpackSerializer, name=name)


def run(settings: Settings, *, index: int = 0, burst: bool = False) -> None:
    worker = build_worker(settings, index=index)
    from .jobs import context

    port = settings.worker_metrics_port + index
    if settings.worker_metrics_port > 0:
        context().metrics.serve(port, host=settings.host)
    log.info("worker %s on %s, queues %s, metrics on :%d", worker.name, context().device,
             [q.name for q in worker.queues], port)
    worker.work(burst=burst, logging_level=settings.log_level.upper(), with_scheduler=False)
