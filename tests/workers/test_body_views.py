"""A request's raw tensor bytes decode as views into its body (gradsvc/wire/tensors.py Tensor.data), not copies: a
worker's body mapped from its handoff file is read in place and unmapped on the reaper thread after the job,
and what outlives a request (a graph's constants, kept with the parsed graph) is copied out of it first."""

from __future__ import annotations

import gc
import time
import uuid
import weakref

import msgspec
import torch
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import from_wire, to_wire
from gradsvc.broker import keys
from gradsvc.broker.graphs import GraphStore
from gradsvc.broker.handoff import INPUT, Handoff
from gradsvc.engine import Engine
from gradsvc.wire import GradientRequest
from gradsvc.runtime.settings import Settings
from workers.jobs import decode_request, make_context

CPU = torch.device("cpu")


class WithConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])  # a lifted constant of the exported graph


def body(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> bytes:
    exported = export_graph(model, (x,))
    return msgspec.msgpack.encode({
        "model": {"graph": exported.graph, "weights": {k: to_wire(v, "msgpack") for k, v in exported.weights.items()}},
        "inputs": to_wire(x, "msgpack"), "targets": to_wire(y, "msgpack"), "loss": "cross_entropy",
        "options": {"numcheck": "off", "memory": False}})


def test_a_handed_off_body_is_decoded_in_place_and_unmapped_by_the_reaper(tmp_path, flushed_redis):
    x, y = torch.randn(5, 3), torch.randint(0, 4, (5,))
    handoff = Handoff(tmp_path)
    mapped = handoff.take(handoff.put("job-1", INPUT, body(WithConstant(), x, y)))
    req = decode_request(mapped, "msgpack")
    weight = req.model.weights["fc.weight"]
    assert isinstance(weight.data, memoryview) and weight.data.obj is mapped  # a view, no copy
    result = Engine().compute(req, device=CPU)
    model = WithConstant()
    nn.functional.cross_entropy(model(x), y).backward()
    assert torch.allclose(from_wire(result.gradients["fc.weight"]), model.fc.weight.grad)

    alive = weakref.ref(mapped)
    taken = [mapped]  # as run_job hands a job's maps to the worker context's reaper
    del req, weight, result, mapped
    ctx = make_context(Settings(worker_device="cpu"), flushed_redis)
    try:
        done = ctx.reaper.submit(taken.clear)
        del taken
        done.result(timeout=5)
    finally:
        ctx.close()
    deadline = time.monotonic() + 5
    while alive() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert alive() is None


def test_graph_constants_that_outlive_the_request_are_copied_out_of_its_body(flushed_redis):
    x, y = torch.randn(5, 3), torch.randint(0, 4, (5,))
    raw = bytearray(body(WithConstant(), x, y))
    req = msgspec.msgpack.decode(raw, type=GradientRequest)
    (const,) = req.model.graph.constants.values()
    assert isinstance(const.data, memoryview)  # as decoded: a view into the body
    engine = Engine()
    prep = engine.prepare(req, "meta")
    (template,) = engine.caches.graph_templates.values()
    assert all(type(c.data) is bytes for c in template.spec.constants.values())

    store = GraphStore(flushed_redis, f"test-views-{uuid.uuid4().hex}", ttl_s=60)
    req = msgspec.msgpack.decode(raw, type=GradientRequest)
    try:
        store.put("owner", prep.graph.ref, req.model.graph, prep.graph_data)
        (kept,) = store.parsed.values()
        assert all(type(c.data) is bytes for c in kept.constants.values())
    finally:
        store.redis.delete(keys.graph_key(store.prefix, "owner", prep.graph.ref))
    del req, const, template, kept
    gc.collect()
    raw[:] = bytes(len(raw))  # the body overwritten: nothing kept reads it
    again = engine.compute(msgspec.msgpack.decode(body(WithConstant(), x, y), type=GradientRequest), device=CPU)
    model = WithConstant()
    nn.functional.cross_entropy(model(x), y).backward()
    assert torch.allclose(from_wire(again.gradients["fc.weight"]), model.fc.weight.grad)
