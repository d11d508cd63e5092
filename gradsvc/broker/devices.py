"""Each worker's device, as the API sees it: every worker writes its device (kind, name, total memory) into one
Redis hash under its RQ worker key at its start and with every heartbeat, and deletes it at its stop; the API
reads those of the live workers a job may go to, for the limits it validates the job under (docs/limits.md).
JSON, never pickle. The API has no GPU: this is how it learns the workers' device memory."""

from __future__ import annotations

import msgspec

from . import keys


class WorkerDevice(msgspec.Struct, frozen=True):
    """A worker's device: `kind` "cpu" or "cuda", `name` ("NVIDIA H200", "cpu"), `total_bytes` its memory
    (a CPU worker's: the host's)."""

    kind: str
    name: str
    total_bytes: int


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(WorkerDevice)


def publish(pipe, prefix: str, worker_key: str, device: WorkerDevice) -> None:
    """Adds the write of `device` for the worker `worker_key` to `pipe` (a pipeline, or a connection)."""
    pipe.hset(keys.worker_devices_key(prefix), worker_key, _ENCODER.encode(device))


def withdraw(connection, prefix: str, worker_key: str) -> None:
    connection.hdel(keys.worker_devices_key(prefix), worker_key)


def live_devices(connection, prefix: str, queue: str) -> list[WorkerDevice]:
    """The devices of the live workers that drain `queue` (RQ's set of them, each checked alive: a worker that
    died without unregistering leaves its entry there until RQ cleans it), in two round trips. A worker that
    wrote no device (an older one) is left out; an entry of a worker no longer alive is deleted."""
    members = sorted(k.decode() if isinstance(k, bytes) else k
                     for k in connection.smembers(keys.rq_queue_workers_key(queue)))
    if not members:
        return []
    with connection.pipeline(transaction=False) as pipe:
        for worker_key in members:
            pipe.exists(worker_key)
        pipe.hmget(keys.worker_devices_key(prefix), members)
        *alive, raw = pipe.execute()
    out = []
    for is_alive, value in zip(alive, raw):
        if is_alive and value is not None:
            try:
                out.append(_DECODER.decode(value))
            except msgspec.DecodeError:
                continue  # written by another version: not trusted for limits
    dead = [k for k, is_alive, value in zip(members, alive, raw) if not is_alive and value is not None]
    if dead:
        connection.hdel(keys.worker_devices_key(prefix), *dead)
    return out
