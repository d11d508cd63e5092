"""The memory a job may use (GRADSVC_MAX_JOB_BYTES, issue 24) through a live stack: the meta-device check counts
what node outputs do not show (a dense kernel's copy of an expanded operand) and the job's intermediates
against the setting (422 `too_large`, nothing queued); a request that passes it and allocates more at run
time fails `out_of_memory` (507) at the worker's heap cap (RLIMIT_DATA), and the same worker serves the next
job."""

from __future__ import annotations

import pytest

from ..stack import client_fixtures, start_stack
from .test_reliability import small_body

JOB_BYTES = 64 << 20


@pytest.fixture(scope="module")
def capped():
    s = start_stack(workers=1, GRADSVC_MAX_JOB_BYTES=str(JOB_BYTES))
    yield s
    s.stop()


http, redis = client_fixtures("capped")


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


def test_a_job_past_the_memory_cap_at_run_time_fails_out_of_memory_and_the_worker_serves_the_next(http, capped):
    r = http.post("/gradients?wait=120", json=upsampled_body())
    assert r.status_code == 507, (r.status_code, r.text[:500], capped.logs()[-2000:])
    assert r.json()["error"]["code"] == "out_of_memory"
    assert all(p.poll() is None for p in capped.workers)  # the worker lives
    r = http.post("/gradients?wait=60", json=small_body())
    assert r.status_code == 200, r.text
