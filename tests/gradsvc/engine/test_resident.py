"""A CPU worker keeps the graph models it ran with their weights in place (its Engine's caches.resident_models,
gradsvc/engine/resident.py): a weight a request names by the same refs as the bytes loaded is not copied again, and
nothing else of one request may reach the next. Each test runs requests whose state would leak (a changed weight,
running statistics a training forward wrote, the HVP check's perturbation, inline weights) and compares the model
the next request gets, and its answer, with a fresh Engine's."""

from __future__ import annotations

import hashlib

import msgspec
import torch
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import from_wire, to_wire
from gradsvc.engine import ComputeError, Engine, EngineConfig
from gradsvc.wire import GradientRequest, Tensor

CPU = torch.device("cpu")


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g)


def by_ref(t: torch.Tensor) -> Tensor:
    """A weight as a worker's BlobStore.resolved leaves it: its bytes, and the refs they were uploaded under."""
    wire = to_wire(t, "msgpack")
    return Tensor(dtype=wire.dtype, shape=wire.shape, data=wire.data, refs=[hashlib.sha256(wire.data).hexdigest()])


def request(model: nn.Module, x, y, *, inline: tuple[str, ...] = (), **options) -> GradientRequest:
    exported = export_graph(model, (x,))
    weights = {k: (to_wire(v, "msgpack") if k in inline else by_ref(v)) for k, v in exported.weights.items()}
    body = {"model": {"graph": exported.graph, "dtype": "float64", "weights": weights},
            "inputs": to_wire(x, "msgpack"), "targets": to_wire(y, "msgpack"), "loss": "cross_entropy",
            "options": {"numcheck": "off", "memory": False, **options}}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def grads(result) -> dict[str, torch.Tensor]:
    return {n: from_wire(t) for n, t in result.gradients.items() if t is not None}


def same_answer(a, b) -> bool:
    ga, gb = grads(a), grads(b)
    return a.loss == b.loss and set(ga) == set(gb) and all(torch.equal(ga[n], gb[n]) for n in ga)


def held(engine: Engine):
    (resident,) = engine.caches.resident_models.values()
    return resident


def test_a_weight_sent_by_the_same_refs_stays_in_place_and_the_answer_is_a_fresh_models():
    engine, net, (x, y) = Engine(), bn_net(), batch()
    req = request(net, x, y)
    first = engine.compute(req, device=CPU)
    resident = held(engine)
    # Buffers (here the running statistics the training forward wrote) always go in again, parameters stay.
    assert sorted(resident.stale(req.model.weights)) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    prep = engine.prepare(req, CPU)
    assert prep.model is resident.model and len(engine.caches.resident_models) == 0  # checked out
    state = prep.model.state_dict()
    for name, t in export_graph(net, (x,)).weights.items():
        assert torch.equal(state[name], t), name  # the sent running statistics, not the forward's
    again = engine.compute(request(net, x, y), device=CPU)
    assert same_answer(first, again) and same_answer(again, Engine().compute(req, device=CPU))


def test_a_changed_weight_is_copied_in_and_the_rest_stay():
    engine, net, (x, y) = Engine(), bn_net().eval(), batch()  # eval: the forward writes no buffer
    engine.compute(request(net, x, y), device=CPU)
    with torch.no_grad():
        net[3].weight.add_(0.5)
    req = request(net, x, y)
    buffers = ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert sorted(held(engine).stale(req.model.weights)) == buffers + ["3.weight"]
    got = engine.compute(req, device=CPU)
    assert same_answer(got, Engine().compute(req, device=CPU))
    assert sorted(held(engine).stale(req.model.weights)) == buffers


def test_a_weight_sent_inline_stays_in_place_only_as_the_same_bytes():
    """Small weights sent inline as raw bytes (the SDK's biases and norms) are known by their bytes' digest: the same
    bytes again are in place, other bytes are copied in; nested lists are always copied in."""
    engine, net, (x, y) = Engine(), bn_net().eval(), batch()
    req = request(net, x, y, inline=("0.weight",))
    engine.compute(req, device=CPU)
    buffers = ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert sorted(held(engine).stale(req.model.weights)) == buffers
    with torch.no_grad():
        net[0].weight[0, 0] += 1.0
    changed = request(net, x, y, inline=("0.weight",))
    assert sorted(held(engine).stale(changed.model.weights)) == ["0.weight", *buffers]
    assert same_answer(engine.compute(changed, device=CPU), Engine().compute(changed, device=CPU))
    listed = msgspec.structs.replace(changed.model.weights["0.weight"], data=net[0].weight.tolist())
    assert "0.weight" in held(engine).stale({**changed.model.weights, "0.weight": listed})


def test_inline_bytes_that_are_a_view_of_the_requests_buffer_are_kept_as_a_copy():
    """A worker's request may hold views of a buffer it reuses for the next body: what the model keeps as a weight's
    identity is a copy, so the buffer's next bytes neither match nor change it."""
    engine, net, (x, y) = Engine(), bn_net().eval(), batch()
    req = request(net, x, y, inline=("0.weight",))
    raw = bytes(req.model.weights["0.weight"].data)
    buffer = bytearray(raw)
    viewed = msgspec.structs.replace(req.model.weights["0.weight"], data=memoryview(buffer))
    engine.compute(msgspec.structs.replace(req, model=msgspec.structs.replace(
        req.model, weights={**req.model.weights, "0.weight": viewed})), device=CPU)
    buffer[:4] = b"\xff\xff\xff\x7f"  # the buffer reused: a NaN where the first weight was
    assert "0.weight" not in held(engine).stale(req.model.weights)  # the bytes loaded, as bytes
    assert "0.weight" in held(engine).stale({**req.model.weights, "0.weight": viewed})
    assert isinstance(held(engine).loaded["0.weight"][0][3], bytes)


def test_a_training_loop_of_changing_weights_matches_a_fresh_engine_at_every_step():
    engine, net = Engine(), bn_net()
    opt = torch.optim.SGD(net[3].parameters(), lr=0.5)  # the last layer trains, the rest stays: a frozen backbone
    for step in range(4):
        x, y = batch(step)
        req = request(net, x, y)
        got, fresh = engine.compute(req, device=CPU), Engine().compute(req, device=CPU)
        assert same_answer(got, fresh), step
        for n, p in net[3].named_parameters():
            p.grad = grads(got)[f"3.{n}"].clone()
        opt.step()


def test_the_hvp_checks_perturbation_does_not_reach_the_next_request():
    engine, net, (x, y) = Engine(), bn_net().eval(), batch()
    vector = {n: to_wire(torch.ones_like(p), "msgpack") for n, p in net.named_parameters()}
    engine.compute(request(net, x, y, hvp={"vector": vector}, numcheck="exact"), device=CPU)
    req = request(net, x, y)
    prep = engine.prepare(req, CPU)
    state = prep.model.state_dict()
    assert all(torch.equal(state[n], p.detach()) for n, p in net.named_parameters())


def test_a_parameter_written_in_the_model_since_its_load_is_copied_in_again():
    engine, net, (x, y) = Engine(), bn_net().eval(), batch()
    engine.compute(request(net, x, y), device=CPU)
    with torch.no_grad():  # whatever wrote it (the HVP check restores what it perturbs, bit for bit)
        held(engine).model.state_dict(keep_vars=True)["0.bias"].add_(1.0)
    prep = engine.prepare(request(net, x, y), CPU)
    assert torch.equal(prep.model.state_dict()["0.bias"], net[0].bias.detach())


def test_a_failed_compute_drops_its_model():
    engine, net, (x, y) = Engine(), bn_net().eval(), batch()
    engine.compute(request(net, x, y), device=CPU)
    with torch.no_grad():
        net[3].weight.fill_(1e308)  # finite, but the logits overflow: a non-finite loss, after prepare
    try:
        engine.compute(request(net, x, y), device=CPU)
    except ComputeError as exc:
        assert exc.code == "non_finite", exc.code
    else:
        raise AssertionError("the overflowing forward did not fail")
    assert len(engine.caches.resident_models) == 0


def test_no_model_is_kept_with_no_bytes_for_them_nor_on_meta():
    net, (x, y) = bn_net(), batch()
    engine = Engine(EngineConfig(resident_model_bytes=0))
    engine.compute(request(net, x, y), device=CPU)
    assert len(engine.caches.resident_models) == 0
    small = Engine(EngineConfig(resident_model_bytes=100))  # under the model's bytes
    small.compute(request(net, x, y), device=CPU)
    assert len(small.caches.resident_models) == 0
    meta = Engine()
    meta.prepare(request(net, x, y), "meta")
    assert len(meta.caches.resident_models) == 0


def test_running_out_of_memory_empties_the_pool(monkeypatch):
    """The pool's models are what a worker can give back at once: an out_of_memory job empties it, so that
    the next job (a retry with micro_batch, a smaller model) has that memory."""
    import importlib

    compute_module = importlib.import_module("gradsvc.engine.compute")  # the package's `compute` is the function

    engine, net, (x, y) = Engine(), bn_net().eval(), batch()
    engine.compute(request(net, x, y), device=CPU)
    other = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    engine.compute(request(other, x, y), device=CPU)
    assert len(engine.caches.resident_models) == 2

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(compute_module, "_inference", no_memory)
    try:
        engine.compute(request(net, x, y), device=CPU)
    except ComputeError as exc:  # a bare MemoryError (no message, as Python raises it) is named as such
        assert exc.code == "out_of_memory" and "(MemoryError)" in exc.message, (exc.code, exc.message)
    else:
        raise AssertionError("no out_of_memory")
    assert len(engine.caches.resident_models) == 0
