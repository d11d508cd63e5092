"""Models held on the worker's device between jobs (gradsvc/engine/resident.py), layer specs and graphs alike: a
repeated request by reference is "resident" with no byte copied and the gradients of a fresh engine bit for bit; a
changed weight is the only one copied; another scope (owner) never checks out the model; a pool at its byte budget
evicts and still answers. Gradients are checked against torch autograd on the same weights."""

from __future__ import annotations

import hashlib

import msgspec
import torch
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import from_wire, to_wire
from gradsvc.engine import Engine, EngineConfig
from gradsvc.wire import GradientRequest, Tensor

CPU = torch.device("cpu")
LAYERS = [{"type": "Linear", "in_features": 6, "out_features": 16}, {"type": "Tanh"},
          {"type": "Linear", "in_features": 16, "out_features": 3}]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g)


def by_ref(t: torch.Tensor, resolved: bool = True) -> Tensor:
    """A weight by reference as a worker hands it to the engine: its bytes filled in (or left in Redis)."""
    wire = to_wire(t.detach(), "msgpack")
    return Tensor(dtype=wire.dtype, shape=wire.shape, data=wire.data if resolved else None,
                  refs=[hashlib.sha256(wire.data).hexdigest()])


def request(model: nn.Module, x, y, *, graph: bool = False, resolved=lambda name: True) -> GradientRequest:
    if graph:
        exported = export_graph(model, (x,))
        spec, state = {"graph": exported.graph}, exported.weights
    else:
        spec, state = {"layers": LAYERS}, model.state_dict()
    weights = {k: by_ref(v, resolved(k)) for k, v in state.items()}
    body = {"model": {**spec, "dtype": "float64", "weights": weights}, "inputs": to_wire(x, "msgpack"),
            "targets": to_wire(y, "msgpack"), "loss": "cross_entropy", "options": {"numcheck": "off", "memory": False}}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def grads(result) -> dict[str, torch.Tensor]:
    return {n: from_wire(t) for n, t in result.gradients.items() if t is not None}


def autograd(model: nn.Module, x, y) -> dict[str, torch.Tensor]:
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def bitwise(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_a_repeated_request_by_reference_is_resident_copies_nothing_and_answers_as_a_fresh_engine():
    for graph in (False, True):
        engine, model, (x, y) = Engine(), net(), batch()
        req = request(model, x, y, graph=graph)
        first = engine.compute(req, device=CPU, scope="alice")
        assert (first.prepared, first.copied_bytes) == ("built", model_bytes(model)), graph
        assert engine.in_place(req, CPU, "alice") == set(req.model.weights), graph
        # The worker leaves the bytes of weights in place in Redis: the engine gets their refs alone.
        again = engine.compute(request(model, x, y, graph=graph, resolved=lambda name: False), device=CPU,
                               scope="alice")
        assert (again.prepared, again.copied_bytes) == ("resident", 0), graph
        fresh = Engine().compute(req, device=CPU, scope="alice")
        assert bitwise(grads(again), grads(fresh)) and again.loss == fresh.loss, graph
        for name, g in autograd(model, x, y).items():
            assert torch.allclose(grads(again)[name], g, rtol=0, atol=1e-12), (graph, name)


def test_a_changed_weight_is_the_only_one_copied_in():
    for graph in (False, True):
        engine, model, (x, y) = Engine(), net(), batch()
        engine.compute(request(model, x, y, graph=graph), device=CPU, scope="alice")
        with torch.no_grad():
            model[2].weight.add_(0.25)
        req = request(model, x, y, graph=graph)
        assert engine.in_place(req, CPU, "alice") == set(req.model.weights) - {"2.weight"}
        got = engine.compute(req, device=CPU, scope="alice")
        assert (got.prepared, got.copied_bytes) == ("resident", model[2].weight.numel() * 8), graph
        assert bitwise(grads(got), grads(Engine().compute(req, device=CPU))), graph


def test_another_scope_never_checks_out_the_model():
    for graph in (False, True):
        engine, model, (x, y) = Engine(), net(), batch()
        req = request(model, x, y, graph=graph)
        engine.compute(req, device=CPU, scope="alice")
        assert engine.in_place(req, CPU, "bob") == set()  # bob's worker fetches every byte
        other = engine.compute(req, device=CPU, scope="bob")
        assert other.prepared == "built" and other.copied_bytes == model_bytes(model), graph
        assert len(engine.caches.resident_models) == 2  # one model each, never shared
        mine = engine.compute(req, device=CPU, scope="alice")
        assert mine.prepared == "resident" and bitwise(grads(mine), grads(other)), graph


def test_a_weight_left_unresolved_that_is_not_in_place_is_a_coded_error_not_a_wrong_answer():
    from gradsvc.engine import SpecError

    engine, model, (x, y) = Engine(), net(), batch()
    try:
        engine.compute(request(model, x, y, resolved=lambda name: name != "0.weight"), device=CPU, scope="alice")
    except SpecError as exc:
        assert exc.code == "tensor_not_found" and "0.weight" in exc.message
    else:
        raise AssertionError("a weight without bytes, not held, was accepted")


def test_a_pool_at_its_byte_budget_evicts_and_still_answers():
    model, (x, y) = net(), batch()
    engine = Engine(EngineConfig(resident_model_bytes=model_bytes(model) + 64))  # one model at a time
    reqs = [request(model, x, y), request(model, x, y, graph=True)]
    for step in range(4):
        req = reqs[step % 2]
        got = engine.compute(req, device=CPU, scope="alice")
        assert got.prepared == "built", step  # the other model took its place
        assert bitwise(grads(got), grads(Engine().compute(req, device=CPU))), step
    pool = engine.caches.resident_models
    assert len(pool) == 1 and pool.evictions == 3 and pool.misses == 4 and pool.hits == 0
    assert pool.bytes <= pool.max_bytes


def test_a_seeded_model_keeps_its_initialisation_in_place():
    engine, (x, y) = Engine(), batch()
    body = {"model": {"layers": LAYERS, "dtype": "float64", "seed": 3}, "inputs": x.tolist(), "targets": y.tolist(),
            "loss": "cross_entropy", "options": {"numcheck": "off", "memory": False}}
    req = msgspec.convert(body, GradientRequest)
    first, again = (engine.compute(req, device=CPU) for _ in range(2))
    assert (first.prepared, again.prepared, again.copied_bytes) == ("built", "resident", 0)
    other_seed = engine.compute(msgspec.convert({**body, "model": {**body["model"], "seed": 4}}, GradientRequest),
                                device=CPU)
    assert other_seed.prepared == "resident" and other_seed.copied_bytes > 0
    assert bitwise(grads(again), grads(first)) and not bitwise(grads(other_seed), grads(first))
    torch.manual_seed(3)
    local = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    for name, g in autograd(local, x, y).items():
        assert torch.allclose(grads(again)[name], g, rtol=0, atol=1e-12), name


class TwoOutputs(nn.Module):
    """forward(x) -> (logits, a scalar of its own): a loss on either output is another program of one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)

    def forward(self, x):
        out = self.a(x)
        return out, out.pow(2).mean()


def test_the_same_graph_with_another_loss_output_takes_over_the_weights_in_place():
    torch.manual_seed(0)
    model, (x, y) = TwoOutputs().double(), batch()
    exported = export_graph(model, (x,))

    def req(loss: str, resolved: bool) -> GradientRequest:
        body = {"model": {"graph": exported.graph, "dtype": "float64",
                          "weights": {k: by_ref(v, resolved) for k, v in exported.weights.items()}},
                "inputs": to_wire(x, "msgpack"), "loss": loss, "options": {"numcheck": "off", "memory": False},
                **({"targets": to_wire(y, "msgpack")} if loss != "output" else {})}
        return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)

    engine = Engine()
    engine.compute(req("cross_entropy", True), device=CPU, scope="alice")
    own = req("output", False)  # what a worker sends on: every weight was in place in the held model
    assert engine.in_place(own, CPU, "alice") == set(own.model.weights)
    got = engine.compute(own, device=CPU, scope="alice")
    assert got.prepared == "built" and got.copied_bytes == model_bytes(model)  # copied on the device
    model.zero_grad()
    model(x)[1].backward()
    for name, p in model.named_parameters():
        assert torch.allclose(grads(got)[name], p.grad, rtol=0, atol=1e-12), name
    again = engine.compute(own, device=CPU, scope="alice")
    assert (again.prepared, again.copied_bytes) == ("resident", 0)


def test_a_weight_sent_inline_then_by_the_ref_of_its_bytes_stays_in_place():
    """The SDK sends a trainable weight in the body the first time and by reference once it comes back unchanged."""
    engine, model, (x, y) = Engine(), net(), batch()

    def req(inline: bool, resolved: bool = True) -> GradientRequest:
        weights = {k: (to_wire(v, "msgpack") if inline else by_ref(v, resolved)) for k, v in model.state_dict().items()}
        body = {"model": {"layers": LAYERS, "dtype": "float64", "weights": weights}, "inputs": to_wire(x, "msgpack"),
                "targets": to_wire(y, "msgpack"), "loss": "cross_entropy",
                "options": {"numcheck": "off", "memory": False}}
        return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)

    first = engine.compute(req(inline=True), device=CPU, scope="alice")
    assert engine.in_place(req(inline=False), CPU, "alice") == set(model.state_dict())
    again = engine.compute(req(inline=False, resolved=False), device=CPU, scope="alice")
    assert (again.prepared, again.copied_bytes) == ("resident", 0) and bitwise(grads(again), grads(first))
    with torch.no_grad():
        model[0].bias.add_(1.0)
    changed = engine.compute(req(inline=False), device=CPU, scope="alice")  # other bytes: copied in
    assert changed.copied_bytes == model[0].bias.numel() * 8
