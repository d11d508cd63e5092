"""Hostile input over real HTTP: every request gets a 4xx with a code, or a failed job with a code;
never a 5xx other than 503; and the worker stays up through all of it."""

from __future__ import annotations

import base64
import copy
import json
import time
from pathlib import Path

import msgspec
import pytest

from tests.support.nets import SEED_A_LAYERS

INPUT_CODES = {"malformed_body", "invalid_body", "bad_request", "body_too_large", "unknown_layer", "shape_mismatch",
               "bad_weights", "bad_tensor", "bad_loss", "bad_target", "bad_option", "too_large", "non_finite",
               "device_unavailable", "result_too_large", "unsupported_media_type", "no_gradient"}


def good() -> dict:
    return {"model": {"layers": copy.deepcopy(SEED_A_LAYERS), "dtype": "float64", "seed": 0},
            "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
            "loss": "cross_entropy", "options": {"numcheck": "off"}}


def mutated(fn) -> dict:
    body = good()
    fn(body)
    return body


def nested(depth: int) -> dict:
    spec: dict = {"type": "Linear", "in_features": 6, "out_features": 3}
    for _ in range(depth):
        spec = {"type": "Sequential", "layers": [spec]}
    return mutated(lambda b: b["model"].__setitem__("layers", [spec]))


def raw(content: bytes, content_type: str = "application/json") -> tuple[bytes, str]:
    return content, content_type


def setp(*path_and_value):
    *path, key, value = path_and_value

    def fn(body: dict) -> None:
        target = body
        for p in path:
            target = target[p]
        target[key] = value
    return fn


def layer(spec: dict):
    return setp("model", "layers", [spec, {"type": "Tanh"}, {"type": "Linear", "in_features": 8, "out_features": 3}])


HOSTILE = {
    # malformed bodies
    "empty body": raw(b""),
    "truncated json": raw(b'{"model": {"layers": [}'),
    "not json at all": raw(b"\x00\xff\xfe garbage"),
    "json array": raw(b"[1, 2, 3]"),
    "json string": raw(b'"gradients please"'),
    "invalid utf-8": raw(b'{"model": "\xff\xfe"}'),
    "nan literal": raw(b'{"model": NaN}'),
    "huge number literal": raw(b'{"model": {"layers": [], "seed": ' + b"9" * 5000 + b"}, \"inputs\": [1]}"),
    "deeply nested json": raw(b"[" * 100_000 + b"]" * 100_000),
    "bad msgpack": raw(b"\xc1\xc1\xc1", "application/msgpack"),
    "msgpack with wrong types": raw(msgspec.msgpack.encode({"model": 3, "inputs": "x"}), "application/msgpack"),
    # schema violations
    "missing model": mutated(lambda b: b.pop("model")),
    "unknown top-level field": mutated(setp("__class__", {"x": 1})),
    "unknown option": mutated(setp("options", "numchek", "exact")),
    "layers not a list": mutated(setp("model", "layers", "Linear")),
    "seed not an int": mutated(setp("model", "seed", "zero")),
    # deep nesting of containers
    "containers nested 64 deep": nested(64),
    "containers nested 5000 deep": raw(b'{"model": {"layers": [' + b'{"type": "Sequential", "layers": [' * 5000
                                       + b'{"type": "Tanh"}' + b"]}" * 5000 + b'], "dtype": "float64"}, '
                                       b'"inputs": [[0.5]], "targets": [[0.5]], "loss": "mse"}'),
    # absurd shapes and sizes
    "out_features 10**12": mutated(layer({"type": "Linear", "in_features": 6, "out_features": 10**12})),
    "out_features 2**64": mutated(layer({"type": "Linear", "in_features": 6, "out_features": 2**64})),
    "negative out_features": mutated(layer({"type": "Linear", "in_features": 6, "out_features": -8})),
    "zero in_features": mutated(layer({"type": "Linear", "in_features": 0, "out_features": 8})),
    "float out_features": mutated(layer({"type": "Linear", "in_features": 6, "out_features": 8.5})),
    "string out_features": mutated(layer({"type": "Linear", "in_features": 6, "out_features": "8"})),
    "bool out_features": mutated(layer({"type": "Linear", "in_features": 6, "out_features": True})),
    "10000 layers": mutated(setp("model", "layers", [{"type": "Tanh"}] * 10_000)),
    "tensor shape 10**9 x 10**9": mutated(setp("inputs", {"dtype": "float64", "shape": [10**9, 10**9], "data": []})),
    "tensor negative shape": mutated(setp("inputs", {"dtype": "float64", "shape": [-2, 6], "data": []})),
    "tensor 100-dim shape": mutated(setp("inputs", {"dtype": "float64", "shape": [1] * 100, "data": [1.0]})),
    "shape/data length mismatch": mutated(setp("inputs", {"dtype": "float64", "shape": [2, 6], "data": [[1.0] * 6]})),
    "ragged nested list": mutated(setp("inputs", [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.1]])),
    "b64 length mismatch": mutated(setp("inputs", {"dtype": "float64", "shape": [2, 6],
                                                   "b64": base64.b64encode(b"\x00" * 7).decode()})),
    "b64 not base64": mutated(setp("inputs", {"dtype": "float64", "shape": [2, 6], "b64": "!!!not base64!!!"})),
    "data and b64 together": mutated(setp("inputs", {"dtype": "float64", "shape": [1], "data": [1.0], "b64": "AA=="})),
    "neither data nor b64": mutated(setp("inputs", {"dtype": "float64", "shape": [2, 6]})),
    "strings in data": mutated(setp("inputs", [["a", "b", "c", "d", "e", "f"]])),
    "nan inputs": mutated(setp("inputs", {"dtype": "float64", "shape": [1, 6],
                                          "b64": base64.b64encode(b"\x00\x00\x00\x00\x00\x00\xf8\x7f" * 6).decode()})),
    "empty batch": mutated(setp("inputs", [])),
    # unknown dtypes
    "unknown tensor dtype": mutated(setp("inputs", {"dtype": "complex64", "shape": [1], "data": [1]})),
    "dtype naming a python object": mutated(setp("inputs", {"dtype": "object", "shape": [1], "data": [1]})),
    "model dtype torch.float64": mutated(setp("model", "dtype", "torch.float64")),
    "model dtype int64": mutated(setp("model", "dtype", "int64")),
    # wrong targets for the loss
    "class index out of range": mutated(setp("targets", [0, 7])),
    "negative class index": mutated(setp("targets", [-1, 0])),
    "float targets for cross_entropy": mutated(setp("targets", [[0.5, 0.5, 0.5], "x"])),
    "targets batch mismatch": mutated(setp("targets", [0, 1, 2, 0, 1])),
    "mse with class indices": mutated(lambda b: b.update(loss="mse")),
    "bce targets outside 0..1": mutated(lambda b: b.update(loss="bce_with_logits", targets=[[5.0] * 3, [-2.0] * 3])),
    "missing targets": mutated(lambda b: b.pop("targets")),
    "unknown loss": mutated(setp("loss", "hinge_of_doom")),
    "bad reduction": mutated(setp("loss", {"type": "mse", "reduction": "__import__"})),
    # names that try to reach Python
    "layer __import__": mutated(layer({"type": "__import__", "name": "os"})),
    "layer eval": mutated(layer({"type": "eval", "source": "__import__('os').system('touch /tmp/pwned')"})),
    "layer exec": mutated(layer({"type": "exec"})),
    "layer torch.nn.Module path": mutated(layer({"type": "torch.nn.modules.linear.Linear", "in_features": 6,
                                                 "out_features": 8})),
    "layer dunder class": mutated(layer({"type": "__class__"})),
    "layer subclasses walk": mutated(layer({"type": "Linear.__class__.__subclasses__"})),
    "dunder constructor argument": mutated(layer({"type": "Linear", "in_features": 6, "out_features": 8,
                                                  "__init__": "x"})),
    "device argument": mutated(layer({"type": "Linear", "in_features": 6, "out_features": 8, "device": "cuda:9"})),
    "dtype argument": mutated(layer({"type": "Linear", "in_features": 6, "out_features": 8, "dtype": "object"})),
    "loss __import__": mutated(setp("loss", "__import__")),
    "loss eval": mutated(setp("loss", {"type": "eval"})),
    "loss dunder": mutated(setp("loss", "__class__")),
    "weight name __dict__": mutated(setp("model", "weights", {"__dict__": {"dtype": "float64", "shape": [1],
                                                                            "data": [1.0]}})),
    "weight name walking attributes": mutated(setp("model", "weights", {"0.weight.__class__": {
        "dtype": "float64", "shape": [1], "data": [1.0]}})),
    "freeze dunder prefix": mutated(setp("options", "freeze", ["__class__"])),
    "hvp vector naming a module": mutated(setp("options", "hvp", {"vector": "os.system"})),
    "pickle bytes in b64": mutated(setp("model", "weights", {"0.weight": {
        "dtype": "float64", "shape": [8, 6], "b64": base64.b64encode(b"\x80\x04cos\nsystem\n.").decode()}})),
    # option abuse
    "negative micro_batch": mutated(setp("options", "micro_batch", -1)),
    "huge timing_repeat": mutated(setp("options", "timing_repeat", 10**9)),
    "zero numcheck_eps": mutated(setp("options", "numcheck_eps", 0.0)),
    "huge numcheck_samples": mutated(setp("options", "numcheck_samples", 10**12)),
    "checkpoint_segments 0": mutated(setp("options", "checkpoint_segments", 0)),
    "device cuda on a cpu box": mutated(setp("options", "device", "cuda")),
}

# An empty tensor whose other sizes overflow int64 (the API's decode once answered 500 for these).
ZERO_AND_HUGE = {"[2^64-1, 0]": [2**64 - 1, 0], "[2^62, 4, 0]": [2**62, 4, 0], "[0, 2^63]": [0, 2**63]}
W = {"dtype": "float64", "shape": [4, 3], "data": [[0.1, -0.2, 0.3]] * 4}
XS = [[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]]
X = {"dtype": "float64", "shape": [2, 3], "data": XS}


def graph_body(last: dict | None = None, two_inputs: bool = False) -> dict:
    """A graph model: linear(x (+ z)) -> `last` (an op node on it, if given), weights and a batch of two."""
    inputs = [{"name": "x", "kind": "input", "dtype": "float64", "shape": [-1, 3]},
              {"name": "w", "kind": "parameter", "target": "weight", "dtype": "float64", "shape": [4, 3]}]
    nodes = [{"name": "lin", "op": "aten.linear.default", "args": [{"node": "x"}, {"node": "w"}]}]
    if two_inputs:
        inputs.insert(1, {"name": "z", "kind": "input", "dtype": "float64", "shape": [-1, 3]})
        nodes.insert(0, {"name": "s", "op": "aten.add.Tensor", "args": [{"node": "x"}, {"node": "z"}]})
        nodes[1]["args"][0] = {"node": "s"}
    if last is not None:
        nodes.append({"name": "out", "args": [{"node": "lin"}], **last})
    graph = {"inputs": inputs, "nodes": nodes, "outputs": [{"node": nodes[-1]["name"]}], "dtype": "float64"}
    return {"model": {"graph": graph, "dtype": "float64", "weights": {"weight": W}},
            "inputs": [X, X] if two_inputs else XS, "targets": [[0.0] * 4, [1.0] * 4], "loss": "mse",
            "options": {"numcheck": "off"}}


def empty(shape: list[int], msgpack: bool = False) -> dict:
    return {"dtype": "float64", "shape": shape, **({"data": b""} if msgpack else {"b64": ""})}


def _zero_and_huge_cases() -> dict:
    cases = {}
    for label, shape in ZERO_AND_HUGE.items():
        for fmt in ("json", "msgpack"):
            packed = fmt == "msgpack"
            forms = {
                "inputs": mutated(setp("inputs", empty(shape, packed))),
                "targets": mutated(setp("targets", empty(shape, packed))),
                "graph inputs list": dict(graph_body(two_inputs=True), inputs=[X, empty(shape, packed)]),
                "graph inputs by name": dict(graph_body(two_inputs=True), inputs={"x": X, "z": empty(shape, packed)}),
                "graph targets": dict(graph_body(), targets=empty(shape, packed)),
            }
            for form, body in forms.items():
                name = f"empty {form} of shape {label} ({fmt})"
                cases[name] = raw(msgspec.msgpack.encode(body), "application/msgpack") if packed else body
    return cases


HOSTILE.update(_zero_and_huge_cases())
HOSTILE["empty inputs of shape [2^64, 0] (json)"] = mutated(setp("inputs", {"dtype": "float64", "shape": [2**64, 0],
                                                                           "b64": ""}))
HOSTILE.update({
    # graphs whose first output has no gradient (the worker once failed them as internal_error)
    "graph output detached": graph_body({"op": "aten.detach.default"}),
    "graph output argmax (int64)": graph_body({"op": "aten.argmax.default", "args": [{"node": "lin"}, 1]}),
    "graph output a comparison (bool)": graph_body({"op": "aten.gt.Scalar", "args": [{"node": "lin"}, 0.0]}),
    "graph output detached, the model's own loss": dict(graph_body({"op": "aten.detach.default"}), loss="output"),
})
# Refused before the queue with exactly this code, on POST /gradients and POST /estimate alike.
REFUSED = {**{name: "too_large" for name in HOSTILE if " of shape " in name and "2^64," not in name},
           **{name: "no_gradient" for name in HOSTILE if name.startswith("graph output ")}}


def _send(http, case, path: str = "/gradients?wait=60"):
    if isinstance(case, tuple):
        content, content_type = case
        return http.post(path, content=content, headers={"content-type": content_type})
    return http.post(path, content=json.dumps(case).encode(), headers={"content-type": "application/json"})


def _final_job(http, job_id: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        job = http.get(f"/jobs/{job_id}").json()
        if job["status"] in ("finished", "failed", "canceled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not end")


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_gets_a_coded_4xx_or_a_coded_failed_job(http, stack, name):
    r = _send(http, HOSTILE[name])
    assert r.status_code < 500 or r.status_code == 503, f"{name}: {r.status_code} {r.text[:500]}"
    if r.status_code == 200:
        return  # accepted as valid input (e.g. bce targets are not range-checked by torch): a real result
    if r.status_code == 202:
        job = _final_job(http, r.json()["job_id"])
        assert job["status"] in ("finished", "failed"), job
        if job["status"] == "failed":
            assert job["error"]["code"] in INPUT_CODES, job["error"]
        return
    body = r.json()
    assert 400 <= r.status_code < 500, f"{name}: {r.status_code} {body}"
    assert body["error"]["code"] in INPUT_CODES | {"unauthorized", "rate_limited"}, body
    assert len(body["error"]["message"]) > 10, body


@pytest.mark.parametrize("name", list(REFUSED))
@pytest.mark.parametrize("path", ["/gradients?wait=60", "/estimate"])
def test_zero_sized_overflowing_shapes_and_gradient_free_outputs_are_refused_before_the_queue(http, stack, name,
                                                                                             path):
    r = _send(http, HOSTILE[name], path)
    assert r.status_code == 422, f"{name}: {r.status_code} {r.text[:500]}"
    error = r.json()["error"]
    assert error["code"] == REFUSED[name] and "job_id" not in r.json(), r.json()


def test_no_hostile_input_took_the_worker_down(http, stack):
    # Runs after the table above (pytest keeps file order).
    for proc in stack.workers:
        assert proc.poll() is None, f"a worker exited; logs in {stack.logdir}"
    assert http.get("/readyz").json()["workers"] >= 1
    r = http.post("/gradients?wait=60", json=good())
    assert r.status_code == 200, r.text
    assert r.json()["parameter_count"] == 83
    assert not Path("/tmp/pwned").exists()
