"""Limits from the device: each worker publishes its device in Redis with its heartbeat; the API validates a job
under the limits of the workers it may go to, on CUDA following the device's memory unless set. No GPU is
needed: a CUDA worker is registered by hand (a worker key, RQ's per-queue set, the device record) in real Redis,
as a worker on a large card registers itself."""

from __future__ import annotations

import time
import uuid

import pytest
from rq.worker import Worker

from gradsvc.broker import devices, keys
from gradsvc.broker.devices import WorkerDevice
from gradsvc.engine import Engine, EngineConfig
from gradsvc.engine.config import MAX_INDEXABLE_ELEMENTS, limits_for_device
from gradsvc.engine.spec import Limits
from gradsvc.runtime.settings import Settings
from service.device_limits import CACHE_S, DeviceLimits

PREFIX = "gradsvc"
H200 = WorkerDevice(kind="cuda", name="NVIDIA H200", total_bytes=150_121_152_512)
T4 = WorkerDevice(kind="cuda", name="Tesla T4", total_bytes=15_828_320_256)
HOST = WorkerDevice(kind="cpu", name="cpu", total_bytes=24 << 30)


def register(redis, device: WorkerDevice, queues: tuple[str, ...], ttl_s: int = 60) -> str:
    """A live worker as RQ registers one (its key, in each queue's worker set) that published `device`."""
    worker_key = f"{Worker.redis_worker_namespace_prefix}fake-{device.kind}-{uuid.uuid4().hex[:8]}"
    redis.hset(worker_key, mapping={"state": "idle", "queues": ",".join(queues)})
    redis.expire(worker_key, ttl_s)
    for queue in queues:
        redis.sadd(keys.rq_queue_workers_key(queue), worker_key)
    devices.publish(redis, PREFIX, worker_key, device)
    return worker_key


def unregister(redis, worker_key: str, queues: tuple[str, ...]) -> None:
    for queue in queues:
        redis.srem(keys.rq_queue_workers_key(queue), worker_key)
    redis.delete(worker_key)
    devices.withdraw(redis, PREFIX, worker_key)


CUDA_QUEUES = (keys.queue_name(PREFIX, "cuda"), keys.queue_name(PREFIX, "auto"))
CPU_QUEUES = (keys.queue_name(PREFIX, "cpu"), keys.queue_name(PREFIX, "auto"))


def test_a_cuda_device_s_limits_follow_its_memory_unless_set():
    base = Limits()
    big = limits_for_device(base, H200.total_bytes)
    assert big.max_elements == MAX_INDEXABLE_ELEMENTS and big.max_graph_intermediate_bytes == H200.total_bytes // 2
    small = limits_for_device(base, T4.total_bytes)
    assert small.max_elements == T4.total_bytes // 64 > 103_000_000  # GPT-2 small's logits at 8 x 256 fit a T4
    tiny = limits_for_device(base, 1 << 30)
    assert tiny.max_elements == base.max_elements  # never below the CPU default
    kept = limits_for_device(Limits(max_elements=1000, max_graph_intermediate_bytes=5000), H200.total_bytes,
                             frozenset({"max_elements", "max_job_bytes"}))
    assert (kept.max_elements, kept.max_graph_intermediate_bytes) == (1000, 5000)
    assert big.max_parameters == base.max_parameters  # the model's size is not the device's to decide


def test_the_settings_say_which_limits_were_set():
    assert Settings.from_env({}).limits_given == frozenset()
    assert Settings.from_env({"GRADSVC_MAX_ELEMENTS": "10"}).limits_given == {"max_elements"}
    assert Settings.from_env({}, max_job_bytes=10).limits_given == {"max_job_bytes"}


def test_the_limits_of_the_workers_a_job_may_go_to(flushed_redis):
    redis = flushed_redis
    base = Engine(EngineConfig())
    limits = DeviceLimits(base, redis, PREFIX)
    nobody = limits.for_device("cuda")
    assert nobody.engine is base and nobody.limits.device == "settings"

    h200 = register(redis, H200, CUDA_QUEUES)
    limits = DeviceLimits(base, redis, PREFIX)
    cuda = limits.for_device("cuda")
    assert cuda.limits.device == "cuda" and cuda.limits.device_name == "NVIDIA H200"
    assert cuda.limits.device_bytes == H200.total_bytes and cuda.limits.max_elements == MAX_INDEXABLE_ELEMENTS
    assert cuda.engine.config.limits == limits_for_device(base.config.limits, H200.total_bytes)
    assert limits.for_device("auto").engine is cuda.engine  # every live worker has a CUDA device
    assert limits.cached("cuda") is cuda  # on the event loop: no Redis

    t4 = register(redis, T4, CUDA_QUEUES)
    host = register(redis, HOST, CPU_QUEUES)
    limits = DeviceLimits(base, redis, PREFIX)
    assert limits.for_device("cuda").limits.device_name == "Tesla T4"  # the smallest card a job may land on
    auto = limits.for_device("auto")
    assert auto.engine is base and auto.limits.device == "cpu"  # a CPU worker may take it: the settings' limits
    assert limits.for_device("cpu").engine is base

    unregister(redis, host, CPU_QUEUES)
    redis.delete(t4)  # died without unregistering: its key expired, its entries stayed
    limits = DeviceLimits(base, redis, PREFIX)
    assert limits.for_device("auto").limits.device_name == "NVIDIA H200"
    assert redis.hget(keys.worker_devices_key(PREFIX), t4) is None  # a dead worker's record is dropped
    given = DeviceLimits(base, redis, PREFIX, frozenset({"max_elements", "max_job_bytes"}))
    assert given.for_device("cuda").limits.max_elements == base.config.limits.max_elements
    unregister(redis, h200, CUDA_QUEUES)


def test_the_devices_are_read_again_after_the_cache_expires(flushed_redis):
    limits = DeviceLimits(Engine(EngineConfig()), flushed_redis, PREFIX)
    assert limits.for_device("cuda").limits.device == "settings"
    register(flushed_redis, H200, CUDA_QUEUES)
    assert limits.for_device("cuda").limits.device == "settings"  # trusted for CACHE_S
    limits._chosen.clear()  # as CACHE_S later
    assert limits.for_device("cuda").limits.device == "cuda"
    assert CACHE_S <= 10


# GPT-2 small's output layer at batch 8 x 256: its logits are 8 x 256 x 50257 = 103M elements, over the settings'
# 64M (GRADSVC_MAX_ELEMENTS), which refused the 124M model on an H200 with 139 GiB free.
LM_HEAD = {"model": {"layers": [{"type": "Embedding", "num_embeddings": 50257, "embedding_dim": 768},
                                {"type": "Linear", "in_features": 768, "out_features": 50257}], "dtype": "float32"},
           "inputs": {"dtype": "int64", "shape": [8, 256]}, "targets": {"dtype": "float32", "shape": [8, 256, 50257]},
           "loss": "mse"}


def _estimate(http, device: str):
    body = {**LM_HEAD, "options": {"device": device, "numcheck": "off"}}
    deadline = time.monotonic() + CACHE_S + 2  # another test may have had the API read the devices just before
    while True:
        answer = http.post("/estimate", json=body)
        if answer.status_code != 422 or device != "cuda" or time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


def test_gpt2_small_s_logits_at_8_x_256_are_accepted_for_a_cuda_worker_with_a_large_card(stack, http):
    redis = stack.redis_client()
    published = [devices._DECODER.decode(v) for v in redis.hgetall(keys.worker_devices_key(PREFIX)).values()]
    assert published  # the stack's own worker published its device (a CPU here; a GPU's on a GPU machine)
    worker_key = register(redis, H200, CUDA_QUEUES)
    try:
        answer = _estimate(http, "cuda")
        assert answer.status_code == 200, answer.text
        limits = answer.json()["limits"]
        assert limits["device"] == "cuda" and limits["device_name"] == "NVIDIA H200"
        assert limits["device_bytes"] == H200.total_bytes and limits["max_elements"] > 103_000_000

        auto = _estimate(http, "auto")
        if any(d.kind == "cpu" for d in published):  # the stack's CPU worker may take it: the settings' 64M
            assert auto.status_code == 422 and auto.json()["error"]["code"] == "too_large", auto.text

        every_position = [*LM_HEAD["model"]["layers"], {"type": "Flatten", "start_dim": 0, "end_dim": 1}]
        body = {"model": {**LM_HEAD["model"], "layers": every_position}, "inputs": [[1] * 256] * 8,
                "targets": [0] * (8 * 256), "loss": "cross_entropy", "options": {"device": "cuda", "numcheck": "off"}}
        queued = http.post("/gradients?wait=0", json=body)
        assert queued.status_code == 202, queued.text  # accepted and queued for the CUDA worker
        # canceled while queued; a GPU machine's own worker may have run it already
        assert http.post(f"/jobs/{queued.json()['job_id']}/cancel").status_code in (200, 409)
    finally:
        unregister(redis, worker_key, CUDA_QUEUES)
        redis.close()


def test_with_redis_out_the_settings_limits_hold_and_are_not_kept():
    import redis as redis_py

    from tests.support.stack import dead_redis_url

    base = Engine(EngineConfig())
    limits = DeviceLimits(base, redis_py.Redis.from_url(dead_redis_url(), socket_connect_timeout=0.5), PREFIX)
    chosen = limits.for_device("cuda")
    assert chosen.engine is base and chosen.limits.device == "settings"
    assert limits.cached("cuda") is None  # read again on the next request
