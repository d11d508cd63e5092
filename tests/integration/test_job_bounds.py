"""One job's bounds through a live two-worker stack that serves other jobs throughout.

Memory (GRADSVC_MAX_JOB_BYTES): the meta-device check counts what node outputs do not show (a dense kernel's
copy of an expanded operand) and a graph's intermediates against the setting (422 `too_large`, nothing
queued); a request that passes it and allocates more at run time fails `out_of_memory` (507) at the worker's
heap cap (RLIMIT_DATA), and the workers go on.

Stop inside one op: SIGTERM and a cancel reach a job that one long C++ op holds: it is reported (`worker_lost`
after SIGTERM, `canceled` after a cancel), never left `started`, and the worker holding it ends (its Python
signal handlers cannot run inside the op: the heartbeat thread sees the signal through the wakeup fd,
workers/watchdog.py)."""

from __future__ import annotations

import signal
import subprocess
import time

from redis import Redis
from rq.job import Job

from ..support.stack import client_fixtures, module_stack, wait_started, wait_status
from .test_hard_deadline import TERMINAL, wedging_body
from .test_reliability import small_body

JOB_BYTES = 64 << 20
# Seconds within which the wedged job must be reported: the grace (TERM_GRACE_S 5 s, CANCEL_GRACE_S 2 s), the
# watchdog's tick, one poll, and slack for a loaded 2-core machine.
BOUND_S = 15


# A worker's heap cap is its own, the job's and its resident models' budget: no models kept here, so past the
# job's bytes is past the cap.
bounded = module_stack(2, GRADSVC_MAX_JOB_BYTES=str(JOB_BYTES), GRADSVC_WORKER_HEARTBEAT_S="1",
                       GRADSVC_RESIDENT_MODEL_BYTES="0")


http, redis = client_fixtures("bounded")


def graph_body(nodes: list[dict], param_shape: list[int]) -> dict:
    """A graph over input x [-1, 4] and parameter p (`param_shape`), the loss on o = x + sum(last node)."""
    n = 1
    for s in param_shape:
        n *= s
    inputs = [{"name": "x", "kind": "input", "dtype": "float32", "shape": [-1, 4]},
              {"name": "p", "kind": "parameter", "target": "p", "dtype": "float32", "shape": param_shape}]
    nodes = [*nodes, {"name": "s", "op": "aten.sum.default", "args": [{"node": nodes[-1]["name"]}]},
             {"name": "o", "op": "aten.add.Tensor", "args": [{"node": "x"}, {"node": "s"}]}]
    graph = {"inputs": inputs, "nodes": nodes, "outputs": [{"node": "o"}], "dtype": "float32"}
    weights = {"p": {"dtype": "float32", "shape": param_shape, "data": [0.01 * (i + 1) for i in range(n)]}}
    return {"model": {"graph": graph, "dtype": "float32", "weights": weights}, "inputs": [[0.1, 0.2, 0.3, 0.4]],
            "targets": [[0.0] * 4], "loss": "mse", "options": {"numcheck": "off"}}


def expanded_matmul_body() -> dict:
    """p [1, 4] expanded to a [20000, 1000, 4] view (no memory) times p.T [4, 1]: the output holds 2e7
    elements, but matmul first copies the view out dense: 8e7 elements (320 MB), above the 64M element
    limit. Every node's output was within the limits, so this passed the check before."""
    return graph_body([{"name": "e", "op": "aten.expand.default", "args": [{"node": "p"}, [20000, 1000, 4]]},
                       {"name": "t", "op": "aten.t.default", "args": [{"node": "p"}]},
                       {"name": "m", "op": "aten.matmul.default", "args": [{"node": "e"}, {"node": "t"}]}], [1, 4])


def intermediates_body() -> dict:
    """Two 8M-element float32 intermediates (64 MB together, a view expanded then materialized), above
    GRADSVC_MAX_JOB_BYTES=64 MiB with the rest: too_large naming the setting."""
    return graph_body([{"name": "e", "op": "aten.expand.default", "args": [{"node": "p"}, [2_000_000, 4]]},
                       {"name": "a", "op": "aten.mul.Tensor", "args": [{"node": "e"}, 2.0]},
                       {"name": "b", "op": "aten.tanh.default", "args": [{"node": "a"}]},
                       {"name": "c", "op": "aten.tanh.default", "args": [{"node": "b"}]}], [4])


def upsampled_body() -> dict:
    """A 20 KB layer spec whose every tensor is within the limits (16.8M elements at most) and which the
    meta-device check passes (layer specs are checked per tensor), but whose forward and backward hold over
    600 MB: a [1, 1, 64, 64] input through a 1x1 convolution, upsampled 64 times, then tanh after tanh (each
    output kept for the backward pass), pooled to one value."""
    layers = [{"type": "Conv2d", "in_channels": 1, "out_channels": 1, "kernel_size": 1},
              {"type": "Upsample", "scale_factor": 64}, *[{"type": "Tanh"}] * 8,
              {"type": "AdaptiveAvgPool2d", "output_size": 1}, {"type": "Flatten"}]
    x = [[[[0.001 * ((i + j) % 7) for i in range(64)] for j in range(64)]]]
    return {"model": {"layers": layers, "dtype": "float32", "seed": 0}, "inputs": x, "targets": [[0.0]],
            "loss": "mse", "options": {"numcheck": "off"}}


def test_a_dense_copy_of_an_expanded_view_is_too_large_before_the_queue(http, redis):
    queued = redis.dbsize()
    for path in ("/gradients?wait=30", "/estimate"):
        r = http.post(path, json=expanded_matmul_body())
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "too_large" and err["detail"]["node"] == "m", err
        assert err["detail"]["elements"] == 80_000_000, err
    assert redis.dbsize() == queued  # nothing queued


def test_intermediates_above_gradsvc_max_job_bytes_are_too_large(http):
    r = http.post("/gradients?wait=30", json=intermediates_body())
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "too_large" and "GRADSVC_MAX_JOB_BYTES" in err["message"], err


def test_a_job_past_the_memory_cap_at_run_time_fails_out_of_memory_and_the_worker_serves_the_next(http, bounded):
    r = http.post("/gradients?wait=120", json=upsampled_body())
    assert r.status_code == 507, (r.status_code, r.text[:500], bounded.logs()[-2000:])
    assert r.json()["error"]["code"] == "out_of_memory"
    assert all(p.poll() is None for p in bounded.workers)  # the worker lives
    r = http.post("/gradients?wait=60", json=small_body())
    assert r.status_code == 200, r.text


def _wedge(http, redis: Redis, stack) -> tuple[str, subprocess.Popen]:
    """A wedged job, started: its id and the worker process that holds it."""
    r = http.post("/gradients?wait=0", json=wedging_body())
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    assert wait_started(redis, [job_id], 1) == [job_id]
    name = redis.hget(Job.key_for(job_id), "worker_name").decode()
    pid = int(name.split("-")[-2])  # gradsvc-<kind>-<host>-<pid>-<index>
    return job_id, next(p for p in stack.workers if p.pid == pid)


def _serves_others(http, n: int = 3) -> None:
    for _ in range(n):
        r = http.post("/gradients?wait=60", json=small_body())
        assert r.status_code == 200, r.text


def _replace(stack, proc: subprocess.Popen) -> None:
    stack.workers.remove(proc)
    stack.start_worker()
    stack.wait_ready(2)


def test_sigterm_to_a_worker_inside_one_long_op_ends_it_and_reports_its_job_worker_lost(http, redis, bounded):
    job_id, proc = _wedge(http, redis, bounded)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _serves_others(http)  # the other worker, meanwhile
    job = wait_status(http, job_id, TERMINAL, BOUND_S)
    print(f"wedged job ended {job['status']} {job.get('error') and job['error']['code']} "
          f"{time.monotonic() - t0:.1f} s after SIGTERM")
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", (job, bounded.logs()[-3000:])
    assert job["error"]["detail"]["hard_stop"] is True
    assert proc.wait(timeout=BOUND_S) == 128 + signal.SIGTERM
    _serves_others(http, 1)
    _replace(bounded, proc)


def test_a_cancel_of_a_job_inside_one_long_op_ends_it_canceled_while_the_other_worker_serves(http, redis, bounded):
    job_id, proc = _wedge(http, redis, bounded)
    t0 = time.monotonic()
    assert http.post(f"/jobs/{job_id}/cancel").status_code == 200
    _serves_others(http)
    job = wait_status(http, job_id, TERMINAL, BOUND_S)
    print(f"wedged job ended {job['status']} {time.monotonic() - t0:.1f} s after the cancel")
    assert job["status"] == "canceled" and job["error"]["code"] == "canceled", job
    proc.wait(timeout=BOUND_S)  # ended for its supervisor to restart (none here: the last test)
    _serves_others(http, 1)
