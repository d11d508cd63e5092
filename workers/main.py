"""`gradsvc worker`'s process: build the GradientWorker for these settings (the process's WorkerContext, its
queues, a warmed-up torch), cap its memory, serve its metrics, and run it; a worker started while Redis is
down waits for it rather than exiting. The context is made here, given to the worker, and closed on exit."""

from __future__ import annotations

import logging
import os
import socket
import time

import torch
from redis import Redis
from rq import Queue

from gradsvc.broker import keys
from gradsvc.broker.connection import connect
from gradsvc.broker.devices import WorkerDevice
from gradsvc.broker.job import GradientJob, MsgpackSerializer
from gradsvc.broker.session_records import SessionRecords
from gradsvc.engine import warm_up_shape_check
from gradsvc.runtime.malloc import cap_data, keep_large_buffers
from gradsvc.runtime.settings import Settings, host_memory_bytes

from .combining import Combining
from .jobs import make_context
from .leasing import REDIS_ERRORS
from .worker import GradientWorker

log = logging.getLogger("gradsvc.worker")


def _warm_up(device: torch.device) -> None:
    # The first matmul allocates BLAS/cuBLAS workspaces; pay that before the first job is timed.
    a = torch.randn(64, 64, device=device, requires_grad=True)
    (a @ a).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # The first shape check on the meta device loads torch's meta kernels (seconds, once per process); without
    # this the first job's prepare_ms carried it (a 2.6 s first job whose passes took 20 ms).
    warm_up_shape_check()


def redis_connection(settings: Settings) -> Redis:
    return connect(settings, socket_connect_timeout=settings.redis_timeout_s,
                   socket_timeout=max(settings.redis_timeout_s, 5.0), health_check_interval=10)


def build_worker(settings: Settings, *, index: int = 0) -> GradientWorker:
    if settings.worker_device != "cpu" and torch.cuda.is_available():
        # One worker per GPU: worker i of `gradsvc up` (or `gradsvc worker --index i`) takes GPU i mod count.
        torch.cuda.set_device(index % torch.cuda.device_count())
    connection = redis_connection(settings)
    ctx = make_context(settings, connection)
    _warm_up(ctx.device)
    kind = ctx.device.type
    name = f"gradsvc-{kind}-{socket.gethostname()}-{os.getpid()}-{index}"
    # Its own queue first (jobs of the models it holds: gradsvc/broker/affinity.py), then the shared ones.
    names = [keys.own_queue_name(settings.queue_prefix, name),
             *keys.worker_queues(settings.queue_prefix, kind, ctx.handoff and ctx.handoff.domain)]
    queues = [Queue(q, connection=connection, serializer=MsgpackSerializer, job_class=GradientJob) for q in names]
    worker = GradientWorker(queues, connection=connection, serializer=MsgpackSerializer, job_class=GradientJob,
                            name=name, heartbeat_s=settings.worker_heartbeat_s, take=settings.worker_take,
                            prefix=settings.queue_prefix,
                            context=ctx)
    worker.device = describe_device(ctx.device)
    if settings.worker_take > 1:  # the jobs it takes together are computed together where they can be
        ctx.combining = Combining(worker.taking)
    return worker


def describe_device(device: torch.device) -> WorkerDevice:
    """This worker's device as the API reads it for the limits (gradsvc/broker/devices.py)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return WorkerDevice(kind="cuda", name=props.name, total_bytes=int(props.total_memory))
    return WorkerDevice(kind="cpu", name="cpu", total_bytes=host_memory_bytes())


def _wait_for_redis(settings: Settings) -> None:
    """A worker started while Redis is down, or refusing writes (its registration is one), waits for it rather
    than exiting."""
    connection = redis_connection(settings)
    delay = 0.5
    while True:
        try:
            connection.set(keys.write_probe_key(settings.queue_prefix), b"1", px=10_000)
            return
        except REDIS_ERRORS as exc:
            log.warning("Redis at %s unreachable or refusing writes (%s); retrying in %.1f s", settings.redis_url,
                        exc, delay)
            time.sleep(delay)
            delay = min(delay * 1.5, 5.0)
        finally:
            connection.close()


def run(settings: Settings, *, index: int = 0, burst: bool = False) -> None:
    keep_large_buffers()
    _wait_for_redis(settings)
    worker = build_worker(settings, index=index)
    ctx = worker.context
    if ctx.device.type == "cpu":  # a CUDA context maps far more than it uses: the device's own OOM holds
        cap = cap_data(settings.max_job_bytes + ctx.engine.config.resident_model_bytes)
        if cap is not None:
            log.info("worker %s: memory capped at %d bytes (RLIMIT_DATA: its own plus GRADSVC_MAX_JOB_BYTES and "
                     "its resident models' GRADSVC_RESIDENT_MODEL_BYTES)", worker.name, cap)

    port = settings.worker_metrics_port + index
    if settings.worker_metrics_port > 0:
        try:
            ctx.metrics.serve(port, host=settings.host)
        except OSError as exc:  # a taken port costs the metrics, not the worker (a restart would not help)
            log.error("worker %s: cannot serve metrics on %s:%d (%s); running without them; set "
                      "GRADSVC_WORKER_METRICS_PORT to a free range", worker.name, settings.host, port, exc)
    log.info("worker %s on %s, queues %s, metrics on :%d", worker.name, ctx.device,
             [q.name for q in worker.queues], port)
    try:
        worker.work(burst=burst, logging_level=settings.log_level.upper(), with_scheduler=False)
    finally:
        _checkpoint_sessions(worker)
        ctx.close()  # the tmpfs pages kept for the next result go with the worker, and its threads


def _checkpoint_sessions(worker: GradientWorker) -> None:
    """A graceful stop (SIGTERM ends work() after the job in hand): every training session this worker holds is
    checkpointed where it stands, so the next worker to take one loses no step."""
    ctx, s = worker.context, worker.context.settings
    if not ctx.sessions.sessions:
        return
    try:
        written = ctx.sessions.checkpoint_all(SessionRecords(worker.connection, s.queue_prefix, s.session_idle_ttl_s,
                                                             worker.name))
        log.info("worker %s: %d training sessions checkpointed on stopping", worker.name, written)
    except REDIS_ERRORS as exc:
        log.warning("worker %s: training sessions not checkpointed on stopping (%s); they resume from their last "
                    "checkpoint", worker.name, exc)
