"""Training sessions in the engine against torch.optim: N session steps end on the weights, buffers and optimizer
state of the same N local steps (float64 to 1e-12, float32 to 1e-6 relative), for SGD with momentum, Adam and
AdamW, with and without global clipping, a BatchNorm model and a graph model; gradient accumulation; the state
through a safetensors checkpoint; a failed step changes nothing."""

from __future__ import annotations

import copy
import hashlib

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradclient.export import export_graph
from gradclient.tensors import to_wire
from gradsvc import wire
from gradsvc.engine import session_state
from gradsvc.engine.config import EngineCaches, EngineConfig
from gradsvc.engine.errors import ComputeError, SpecError
from gradsvc.engine.frozen import FrozenStore
from gradsvc.engine.session import footprint, open_session

CPU = torch.device("cpu")
OPTIMIZERS = [
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)),
    ("adam", dict(lr=1e-2, betas=(0.8, 0.95))),
    ("adamw", dict(lr=1e-2, weight_decay=0.1)),
]
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
LAYERS = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "BatchNorm1d", "num_features": 8},
          {"type": "Tanh"}, {"type": "Linear", "in_features": 8, "out_features": 3}]


def local_bn_net(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batches(n: int, dtype: torch.dtype, rows: int = 5):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 6, generator=g, dtype=dtype), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(n)]


def session_for(model_spec: dict, kind: str, args: dict, clip: float | None = None, **options):
    body = {"model": model_spec, "optimizer": {"type": kind, **args}, "options": options}
    if clip is not None:
        body["options"]["clip"] = {"max_norm": clip}
    create = msgspec.convert(body, wire.SessionCreate)
    config = EngineConfig()
    return open_session(create, config, EngineCaches.for_config(config), CPU)


def batch(x: torch.Tensor, y: torch.Tensor, loss: str = "cross_entropy", **fields) -> wire.SessionBatch:
    return msgspec.convert({"inputs": to_wire(x), "targets": to_wire(y), "loss": loss, **fields}, wire.SessionBatch)


def local_steps(model: nn.Module, kind: str, args: dict, data, clip: float | None, accumulate: int = 1):
    opt = TORCH[kind](model.parameters(), **args)
    for i in range(0, len(data), accumulate):
        for x, y in data[i:i + accumulate]:
            F.cross_entropy(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return opt


def assert_same_state(session, model: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    rtol, atol = (1e-12, 1e-12) if dtype == torch.float64 else (1e-6, 1e-7)
    mine = session.model.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(mine[name], value, rtol=rtol, atol=atol, msg=name)
    theirs = opt.state_dict()["state"]
    ours = session.optimizer.state_dict()["state"]
    assert set(ours) == set(theirs)
    for i in theirs:
        for key, value in theirs[i].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(ours[i][key], value, rtol=rtol, atol=atol, msg=f"{i}.{key}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("kind, args", OPTIMIZERS)
def test_session_steps_equal_local_torch_optim_steps_with_batchnorm(kind, args, clip, dtype):
    name = str(dtype).removeprefix("torch.")
    local = local_bn_net(dtype)
    spec = {"layers": LAYERS, "dtype": name, "weights": {k: to_wire(v) for k, v in local.state_dict().items()}}
    session = session_for(spec, kind, args, clip)
    data = batches(4, dtype)
    for x, y in data:
        out = session.train_step(batch(x, y))
        assert out.grad_norm > 0 and (out.clip is not None) == (clip is not None)
    opt = local_steps(local, kind, args, data, clip)
    assert session.step == 4
    assert_same_state(session, local, opt, dtype)
    assert int(session.model.state_dict()["1.num_batches_tracked"]) == 4  # the buffers trained too


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.norm(self.emb(tokens)).mean(dim=1))


@pytest.mark.parametrize("clip", [None, 0.1])
@pytest.mark.parametrize("kind, args", OPTIMIZERS)
def test_session_steps_equal_local_steps_for_a_graph_model_in_float64(kind, args, clip):
    torch.manual_seed(0)
    local = TinyLM().double()
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    eg = export_graph(copy.deepcopy(local), (data[0][0],))
    spec = {"graph": msgspec.to_builtins(eg.graph), "dtype": "float64",
            "weights": {k: to_wire(v.double()) for k, v in eg.weights.items()}}
    session = session_for(spec, kind, args, clip)
    for x, y in data:
        session.train_step(batch(x, y))
    opt = local_steps(local, kind, args, data, clip)
    assert_same_state(session, local, opt, torch.float64)


def test_forward_backward_accumulates_until_optim_step_as_two_backward_calls_do():
    local = local_bn_net(torch.float64)
    spec = {"layers": LAYERS, "dtype": "float64", "weights": {k: to_wire(v) for k, v in local.state_dict().items()}}
    session = session_for(spec, "adamw", {"lr": 1e-2}, clip=0.05)
    data = batches(4, torch.float64)
    for i, (x, y) in enumerate(data):
        session.forward_backward(batch(x, y))
        assert session.accumulated == i % 2 + 1
        if i % 2:
            out = session.optim_step()
            assert out.grad_norm > 0
    opt = local_steps(local, "adamw", {"lr": 1e-2}, data, 0.05, accumulate=2)
    assert session.step == 2
    assert_same_state(session, local, opt, torch.float64)


def test_the_state_survives_safetensors_bytes_and_training_goes_on_identically():
    local = local_bn_net(torch.float64)
    spec = {"layers": LAYERS, "dtype": "float64", "weights": {k: to_wire(v) for k, v in local.state_dict().items()}}
    first = session_for(spec, "adam", {"lr": 1e-2})
    data = batches(4, torch.float64)
    for x, y in data[:2]:
        first.train_step(batch(x, y))
    first.forward_backward(batch(*data[2]))  # a gradient waiting for optim_step goes into the checkpoint too
    data_bytes = session_state.to_bytes(*first.state())
    assert b"pickle" not in data_bytes[:64]
    config = EngineConfig()
    create = msgspec.convert({"model": spec, "optimizer": {"type": "adam", "lr": 1e-2}}, wire.SessionCreate)
    second = open_session(create, config, EngineCaches.for_config(config), CPU, restoring=True)
    second.restore(*session_state.from_bytes(data_bytes))
    assert (second.step, second.accumulated) == (2, 1)
    for s in (first, second):
        s.optim_step()
        s.train_step(batch(*data[3]))
    for name, value in first.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], value), name
    assert first.optimizer.state_dict()["state"].keys() == second.optimizer.state_dict()["state"].keys()


def test_a_non_finite_step_changes_nothing():
    local = local_bn_net(torch.float64)
    spec = {"layers": LAYERS, "dtype": "float64", "weights": {k: to_wire(v) for k, v in local.state_dict().items()}}
    session = session_for(spec, "sgd", {"lr": 0.1, "momentum": 0.9})
    x, y = batches(1, torch.float64)[0]
    session.train_step(batch(x, y))
    before = {k: v.clone() for k, v in session.model.state_dict().items()}
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(SpecError):  # prepare refuses the NaN input before anything runs
        session.train_step(batch(bad, y))
    target = torch.full((5, 3), 1e200, dtype=torch.float64)  # the squared error overflows
    with pytest.raises(ComputeError) as err:
        session.train_step(batch(x, target, loss="mse"))
    assert err.value.code == "non_finite"
    for k, v in session.model.state_dict().items():
        assert torch.equal(v, before[k]), k  # BatchNorm's running statistics included
    assert (session.step, session.accumulated) == (1, 0)


def test_refuses_options_a_step_cannot_honour_and_arguments_the_optimizer_lacks():
    spec = {"layers": LAYERS, "dtype": "float64"}
    with pytest.raises(SpecError, match="Adam takes no 'momentum'"):
        session_for(spec, "adam", {"momentum": 0.9})
    with pytest.raises(SpecError, match="refused the arguments"):
        session_for(spec, "sgd", {"nesterov": True})
    config = EngineConfig()
    for model in ({}, {"layers": LAYERS, "graph_ref": "0" * 64}):  # a 500 TypeError before, from POST /sessions
        create = msgspec.convert({"model": model, "optimizer": {"type": "sgd"}}, wire.SessionCreate)
        with pytest.raises(SpecError, match="exactly one of 'layers', 'graph' or 'graph_ref'"):
            footprint(create, config, EngineCaches.for_config(config))
        with pytest.raises(SpecError, match="exactly one of 'layers', 'graph' or 'graph_ref'"):
            open_session(create, config, EngineCaches.for_config(config), CPU)
    session = session_for(spec, "sgd", {})
    x, y = batches(1, torch.float64)[0]
    with pytest.raises(SpecError, match="options.hvp"):
        session.train_step(batch(x, y, options={"hvp": {}}))
    with pytest.raises(SpecError, match="no gradient waits"):
        session.optim_step()


def test_a_step_asked_for_the_numerical_check_gets_it_and_trains_as_without():
    local = local_bn_net(torch.float64)
    spec = {"layers": LAYERS, "dtype": "float64", "weights": {k: to_wire(v) for k, v in local.state_dict().items()}}
    session = session_for(spec, "adam", {"lr": 1e-2})
    data = batches(2, torch.float64)
    for i, (x, y) in enumerate(data):
        out = session.train_step(batch(x, y, options={"numcheck": "exact"} if i == 1 else {}))
        assert (out.check is not None) == (i == 1)
    assert out.check.mode == "exact" and out.check.passed and out.check.max_rel_error < 1e-6
    opt = local_steps(local, "adam", {"lr": 1e-2}, data, None)
    assert_same_state(session, local, opt, torch.float64)


def test_a_step_answers_the_gradient_norms_asked_for_and_refuses_the_per_example_diagnostics():
    local = local_bn_net(torch.float64)
    spec = {"layers": LAYERS, "dtype": "float64", "weights": {k: to_wire(v) for k, v in local.state_dict().items()}}
    session = session_for(spec, "sgd", {"lr": 0.1})
    x, y = batches(1, torch.float64)[0]
    F.cross_entropy(local(x), y).backward()
    want = torch.sqrt(sum(p.grad.pow(2).sum() for p in local.parameters()))
    out = session.train_step(batch(x, y, options={"diagnostics": ["norms"]}))
    assert out.diagnostics.norms.global_ == pytest.approx(float(want), rel=1e-12)
    assert out.grad_norm == pytest.approx(float(want), rel=1e-12)
    with pytest.raises(SpecError, match="no per-example"):
        session.train_step(batch(x, y, options={"diagnostics": ["variance"]}))


def test_a_run_steps_update_is_the_one_before_it_and_survives_a_checkpoint():
    """optim_step(norms=True) answers, in extra["update"], the squares of the update before it (none on the first
    step), frozen parameters included with nothing moved: a run step's update_ratio, as a /gradients run's."""
    local = local_bn_net(torch.float64)
    spec = {"layers": LAYERS, "dtype": "float64", "weights": {k: to_wire(v) for k, v in local.state_dict().items()}}
    session = session_for(spec, "adam", {"lr": 1e-2}, freeze=["0.bias"])
    data = batches(3, torch.float64)
    weights = [{n: p.detach().clone() for n, p in session.model.named_parameters()}]
    updates = []
    for x, y in data[:2]:
        updates.append(session.train_step(batch(x, y), norms=True).extra["update"])
        weights.append({n: p.detach().clone() for n, p in session.model.named_parameters()})
    assert updates[0] is None
    assert updates[1].keys() == weights[0].keys()
    for name, (moved, base) in updates[1].items():
        assert moved == pytest.approx(float((weights[1][name] - weights[0][name]).pow(2).sum()), rel=1e-12), name
        assert base == pytest.approx(float(weights[0][name].pow(2).sum()), rel=1e-12), name
    assert updates[1]["0.bias"][0] == 0.0 and updates[1]["0.bias"][1] > 0
    config = EngineConfig()
    create = msgspec.convert({"model": spec, "optimizer": {"type": "adam", "lr": 1e-2},
                              "options": {"freeze": ["0.bias"]}}, wire.SessionCreate)
    restored = open_session(create, config, EngineCaches.for_config(config), CPU, restoring=True)
    restored.restore(*session_state.from_bytes(session_state.to_bytes(*session.state())))
    third = restored.train_step(batch(*data[2]), norms=True).extra["update"]
    for name, (moved, base) in third.items():
        assert moved == pytest.approx(float((weights[2][name] - weights[1][name]).pow(2).sum()), rel=1e-12), name
        assert base == pytest.approx(float(weights[1][name].pow(2).sum()), rel=1e-12), name
    assert session_for(spec, "sgd", {"lr": 0.1}).train_step(batch(*data[0])).extra["update"] is None


def test_complex_tensors_safetensors_has_no_name_for_come_back_from_a_checkpoint_complex():
    state = {"w": torch.randn(3, 2, dtype=torch.complex128), "h": torch.randn(2, dtype=torch.complex64),
             "b": torch.randn(2, dtype=torch.float64)}
    back, meta = session_state.from_bytes(session_state.to_bytes(state, {"step": "3"}))
    assert meta["step"] == "3" and {n: t.dtype for n, t in back.items()} == {n: t.dtype for n, t in state.items()}
    for name, t in state.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("dtype, refused", [(torch.float32, 1e39), (torch.float16, 7e4), (torch.bfloat16, 4e38)])
def test_an_lr_or_optimizer_argument_beyond_the_dtype_is_a_bad_option_naming_it(dtype, refused):
    session_state.check_step_values(1e30 if dtype != torch.float16 else 6e4, {dtype})
    for lr in (refused, float("inf"), float("nan")):
        with pytest.raises(SpecError) as err:
            session_state.check_step_values(lr, {torch.float64, dtype})
        assert err.value.code == "bad_option" and err.value.detail["option"] == "lr" and str(dtype) in err.value.message
    spec = wire.OptimizerSpec(type="adam", lr=1e-3, eps=refused)
    with pytest.raises(SpecError) as err:
        session_state.check_arguments(spec, dtype)
    assert err.value.detail["option"] == "optimizer.eps"


def _frozen_base_create(net: nn.Module, frozen: list[str], with_bytes: bool = True) -> wire.SessionCreate:
    """A session of `net` as a layer spec whose `frozen` weights come by reference (their refs, and their bytes as
    the worker fills them in; `with_bytes=False`: the refs alone, as a session's record keeps them)."""
    weights = {}
    for name, t in net.state_dict().items():
        w = msgspec.to_builtins(to_wire(t))
        if name in frozen:
            raw = t.contiguous().numpy().tobytes()
            w = {"dtype": w["dtype"], "shape": w["shape"], "refs": [hashlib.sha256(raw).hexdigest()]}
            if with_bytes:
                w["data"] = raw
        weights[name] = w
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Tanh"},
              {"type": "Linear", "in_features": 8, "out_features": 3}]
    return msgspec.convert({"model": {"layers": layers, "dtype": "float64", "weights": weights},
                            "optimizer": {"type": "adamw", "lr": 1e-2}, "options": {"freeze": frozen}},
                           wire.SessionCreate)


def test_sessions_on_one_base_share_its_frozen_weights_and_checkpoint_only_their_own_state():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    frozen = ["0.weight", "0.bias"]
    config, store = EngineConfig(), FrozenStore()
    caches = EngineCaches.for_config(config)
    create = _frozen_base_create(net, frozen)
    a, b = (open_session(create, config, caches, CPU, frozen=store) for _ in range(2))
    assert a.shared == b.shared == set(frozen) and len(store) == 2
    assert a.model.get_parameter("0.weight") is b.model.get_parameter("0.weight")  # one copy
    assert store.held_bytes == (48 + 8) * 8 and a.state_bytes < state_bytes_of(net)
    data = batches(3, torch.float64)
    for x, y in data:
        a.train_step(batch(x, y))
    local = copy.deepcopy(net)
    for name, p in local.named_parameters():
        p.requires_grad_(name not in frozen)
    opt = torch.optim.AdamW([p for p in local.parameters() if p.requires_grad], lr=1e-2)
    for x, y in data:
        F.cross_entropy(local(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(a.model.state_dict(), local.state_dict(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.model.get_parameter("0.weight"), net.get_parameter("0.weight"))  # never written
    saved, meta = a.state()
    assert not any(n.startswith(("model/0.", "grad/0.", "optim/0.")) for n in saved)  # the base is not in it
    record = _frozen_base_create(net, frozen, with_bytes=False)  # refs alone: found in the store
    back = open_session(record, config, caches, CPU, restoring=True, frozen=store)
    back.restore(*session_state.from_bytes(session_state.to_bytes(saved, meta)))
    torch.testing.assert_close(back.model.state_dict(), a.model.state_dict(), rtol=0, atol=0)
    fresh = FrozenStore()  # another worker: the base's bytes are needed
    with pytest.raises(SpecError) as err:
        open_session(record, config, caches, CPU, restoring=True, frozen=fresh)
    assert err.value.code == "tensor_not_found"
    elsewhere = open_session(create, config, caches, CPU, restoring=True, frozen=fresh)
    elsewhere.restore(*session_state.from_bytes(session_state.to_bytes(saved, meta)))
    torch.testing.assert_close(elsewhere.model.state_dict(), a.model.state_dict(), rtol=0, atol=0)
    del a, b, back, elsewhere
    assert len(store) == 0  # the base goes with the last session naming it


def state_bytes_of(net: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in net.state_dict().values())


def _graph_base_create(net: nn.Module, eg, dtype: str, with_bytes: bool, sent: str | None = None) -> wire.SessionCreate:
    """A graph session of `net` in `dtype` whose embedding is frozen and sent by reference in `sent` (the model's
    dtype by default; its bytes only `with_bytes`)."""
    sent = sent or dtype
    weights = {k: msgspec.to_builtins(to_wire(v.to(getattr(torch, dtype)))) for k, v in eg.weights.items()}
    raw = net.emb.weight.detach().to(getattr(torch, sent)).contiguous().numpy().tobytes()
    weights["emb.weight"] = {"dtype": sent, "shape": list(net.emb.weight.shape),
                             "refs": [hashlib.sha256(raw).hexdigest()], **({"data": raw} if with_bytes else {})}
    return msgspec.convert({"model": {"graph": msgspec.to_builtins(eg.graph), "dtype": dtype, "weights": weights},
                            "optimizer": {"type": "sgd", "lr": 0.1}, "options": {"freeze": ["emb.weight"]}},
                           wire.SessionCreate)


def test_a_graph_session_of_a_base_the_store_holds_takes_it_without_its_bytes_and_in_its_own_dtype_only():
    """The store's base is taken as it is (no copy, no pieces fetched: the worker leaves its refs alone,
    FrozenStore.holding); a session of another dtype finds nothing held for it and needs the bytes."""
    torch.manual_seed(0)
    net = TinyLM().double()
    eg = export_graph(copy.deepcopy(net), (torch.randint(0, 11, (4, 5)),))
    config, store = EngineConfig(), FrozenStore()
    caches = EngineCaches.for_config(config)
    first = open_session(_graph_base_create(net, eg, "float64", True), config, caches, CPU, frozen=store)
    refs_only_ = _graph_base_create(net, eg, "float64", False)
    assert set(store.holding(refs_only_.model.weights, {"emb.weight"}, CPU)) == {"emb.weight"}
    second = open_session(refs_only_, config, caches, CPU, frozen=store)
    assert second.model.get_parameter("emb.weight") is first.model.get_parameter("emb.weight")
    tokens = torch.randint(0, 11, (4, 5))
    torch.testing.assert_close(second.model(tokens), net(tokens), rtol=0, atol=0)
    other = _graph_base_create(net, eg, "float32", False)
    assert set(store.holding(other.model.weights, {"emb.weight"}, CPU)) == set()  # other bytes: other refs
    wider = _graph_base_create(net, eg, "float32", False, sent="float64")  # the same pieces, a float32 model
    assert set(store.holding(wider.model.weights, {"emb.weight"}, CPU)) == {"emb.weight"}  # held, in float64
    with pytest.raises(SpecError) as err:  # so the worker builds it again with the pieces (session_jobs._opened)
        open_session(wider, config, caches, CPU, frozen=store)
    assert err.value.code == "tensor_not_found"
