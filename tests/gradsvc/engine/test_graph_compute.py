"""Graph models through prepare() and compute(), in process: weights, graph_ref, options, memory,
training semantics, thread safety. (The graph format itself is tests/gradsvc/engine/test_graph.py's.)"""

from __future__ import annotations

import threading

import fakeredis
import msgspec
import pytest
import redis.exceptions as redis_errors
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradclient.export import export_graph
from gradclient.tensors import from_wire, to_wire
from gradsvc import hashing
from gradsvc.broker import keys
from gradsvc.broker.graphs import GraphStore
from gradsvc.engine import EngineConfig, SpecError, compute, estimate, prepare
from gradsvc.wire import GradientRequest

from tests.support.models import CASES, local_gradients

CONFIG = EngineConfig()


def request(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str = "cross_entropy", *, graph=None,
            weights: dict | None = None, **options) -> GradientRequest:
    exported = export_graph(model, (x,))
    weights = exported.weights if weights is None else weights
    spec = {"graph_ref": graph} if isinstance(graph, str) else {"graph": exported.graph}
    body = {"model": {**spec, "dtype": str(x.dtype).removeprefix("torch.") if x.is_floating_point() else "float32",
                      "weights": {k: to_wire(v, "msgpack") for k, v in weights.items()}},
            "inputs": to_wire(x, "msgpack"), "targets": to_wire(y, "msgpack"), "loss": loss,
            "options": {"numcheck": "off", **options}}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=GradientRequest)


def grads(result) -> dict[str, torch.Tensor]:
    return {n: from_wire(t) for n, t in result.gradients.items() if t is not None}


def close(got: dict, want: dict, tol: float) -> bool:
    return set(got) == set(want) and all(
        float((got[n] - w).abs().max()) <= tol * max(float(w.abs().max()), 1e-30) for n, w in want.items())


@pytest.fixture(scope="module")
def unet():
    model, x, y, loss = CASES["unet_skip"](torch.float64)
    return model, x, y, loss, request(model, x, y, loss)


def test_graph_gradients_come_back_under_state_dict_names_with_a_ref(unet):
    model, x, y, loss, req = unet
    result = compute(req, CONFIG)
    assert close(grads(result), local_gradients(model, x, y, loss), 1e-12)
    assert result.graph_ref == hashing.digest(hashing.encode(req.model.graph))


def test_module_names_with_hyphens_come_back_under_their_state_dict_names():
    # torchvision's RegNet names its blocks "block1-0": PyTorch allows any character in a name but "."
    torch.manual_seed(0)
    stage = nn.Sequential()
    stage.add_module("block1-0", nn.Linear(4, 6))
    stage.add_module("block1-1", nn.Tanh())
    model, x, y = nn.Sequential(stage, nn.Linear(6, 3)).double(), torch.randn(5, 4, dtype=torch.float64), \
        torch.tensor([0, 1, 2, 0, 1])
    result = compute(request(model, x, y), CONFIG)
    assert set(result.gradients) == {"0.block1-0.weight", "0.block1-0.bias", "1.weight", "1.bias"}
    assert close(grads(result), local_gradients(model, x, y, "cross_entropy"), 1e-12)


def test_missing_weights_are_refused_saying_there_is_no_default_init(unet):
    model, x, y, loss, _ = unet
    weights = dict(export_graph(model, (x,)).weights)
    weights.pop("dec.bias")
    with pytest.raises(SpecError) as err:
        prepare(request(model, x, y, loss, weights=weights), CONFIG)
    assert err.value.code == "bad_weights" and err.value.detail["parameter"] == "dec.bias"
    assert "no default initialisation" in err.value.message


def test_unknown_and_misshapen_weights_name_the_tensor(unet):
    model, x, y, loss, _ = unet
    weights = dict(export_graph(model, (x,)).weights)
    for bad, name in (({**weights, "dec.scale": torch.ones(2)}, "dec.scale"),
                      ({**weights, "enc.bias": torch.ones(7)}, "enc.bias")):
        with pytest.raises(SpecError) as err:
            prepare(request(model, x, y, loss, weights=bad), CONFIG)
        assert err.value.code == "bad_weights" and name in err.value.message


def test_a_graph_ref_resolves_through_the_store_or_is_graph_not_found(unet):
    model, x, y, loss, req = unet
    ref = compute(req, CONFIG).graph_ref
    by_ref = request(model, x, y, loss, graph=ref)
    seen = []
    result = compute(by_ref, CONFIG, graphs=lambda r: seen.append(r) or req.model.graph)
    assert seen == [ref] and close(grads(result), local_gradients(model, x, y, loss), 1e-12)
    with pytest.raises(SpecError) as err:
        prepare(request(model, x, y, loss, graph="f" * 64), CONFIG, graphs=lambda r: None)
    assert err.value.code == "graph_not_found" and "model.graph" in err.value.message
    with pytest.raises(SpecError) as err:  # never a Redis key of the caller's making
        prepare(request(model, x, y, loss, graph="x" * 100_000), CONFIG, graphs=lambda r: pytest.fail(r[:20]))
    assert err.value.code == "graph_not_found" and "64 hex digits" in err.value.message


def test_checkpoint_segments_and_batch_statistics_options_are_refused_on_meta():
    model, x, y, loss = CASES["resnet_block"](torch.float32)
    with pytest.raises(SpecError) as err:
        prepare(request(model, x, y, loss, checkpoint_segments=2), CONFIG)
    assert err.value.code == "bad_option" and "checkpoint_segments" in err.value.message
    for option in ({"micro_batch": 2}, {"per_sample": "norms"}):
        with pytest.raises(SpecError) as err:
            prepare(request(model, x, y, loss, **option), CONFIG)
        assert err.value.code == "bad_option" and err.value.detail["module"] == "bn1", err.value.message
    model.eval()  # running statistics instead of batch statistics: nothing mixes the batch
    prepare(request(model, x, y, loss, micro_batch=2), CONFIG)


def test_memory_rows_are_module_paths_and_add_up(unet):
    model, x, y, loss, req = unet
    memory = compute(req, CONFIG).memory
    names = [row.name for row in memory.layers]
    assert len(names) == len(set(names)) and set(names) <= {n for n, _ in model.named_modules()}
    assert {"enc", "dec"} <= set(names)
    assert sum(row.saved_bytes for row in memory.layers) == memory.saved_bytes_total > 0
    dec = next(row for row in memory.layers if row.name == "dec")
    assert dec.type == "Conv2d" and dec.parameter_bytes == 8 * sum(p.numel() for p in model.dec.parameters())
    assert dec.output_shape == list(model(x).shape)  # dec is the last module: its output is the model's
    predicted = estimate(req, CONFIG).memory
    assert [(r.name, r.saved_bytes) for r in predicted.layers] == [(r.name, r.saved_bytes) for r in memory.layers]


class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def test_dropout_masks_are_seeded_and_fixed_across_the_numerical_check():
    torch.manual_seed(0)
    model = Dropping().double().train()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    req = request(model, x, y, numcheck="exact")
    first, second = compute(req, CONFIG), compute(req, CONFIG)
    assert first.numcheck.passed and first.numcheck.max_rel_error < 1e-6
    assert close(grads(first), grads(second), 0.0)
    assert not close(grads(first), local_gradients(model.eval(), x, y, "cross_entropy"), 1e-3)  # dropout ran


def test_hvp_through_attention_equals_double_backward_with_the_math_kernel():
    model, x, y, loss = CASES["prenorm_block"](torch.float64)
    result = compute(request(model, x, y, loss, hvp={"vector": "random", "seed": 3}), CONFIG)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(3)
    v = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in params.items()}
    with sdpa_kernel([SDPBackend.MATH]):
        value = nn.functional.cross_entropy(model(x), y)
        g = torch.autograd.grad(value, list(params.values()), create_graph=True)
        hv = torch.autograd.grad(g, list(params.values()), grad_outputs=[v[n] for n in params])
    assert close({n: from_wire(t) for n, t in result.hvp.items()}, dict(zip(params, hv)), 1e-10)


def test_token_ids_beyond_the_embedding_are_refused_before_the_queue():
    model, x, y, loss = CASES["hf_bert"](torch.float32)
    with pytest.raises(SpecError) as err:
        prepare(request(model, x + 16, y, loss), CONFIG)
    assert err.value.code == "bad_tensor" and "[0, 15]" in err.value.message


def test_prepare_from_eight_threads_sees_no_error_and_the_right_shapes():
    cases = []
    for name in ("unet_skip", "prenorm_block"):
        model, x, y, loss = CASES[name](torch.float32)
        req = request(model, x, y, loss)
        ref = compute(req, CONFIG).graph_ref
        cases += [(req, None, list(model(x).shape)), (request(model, x, y, loss, graph=ref), req.model.graph,
                                                      list(model(x).shape))]
    errors, shapes = [], []

    def hammer(k: int) -> None:
        try:
            for i in range(12):
                req, graph, want = cases[(k + i) % len(cases)]
                prep = prepare(req, CONFIG, "meta", graphs=lambda r, g=graph: g)
                shapes.append(prep.output_shape == want)
        except Exception as exc:  # noqa: BLE001 - any exception is the failure this test looks for
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(shapes) == 96 and all(shapes)


@pytest.fixture()
def stored(unet):
    """(Redis, a GraphStore, the graph, its bytes and ref), the graph put for owner "alice"."""
    graph = unet[-1].model.graph
    redis = fakeredis.FakeRedis()
    store = GraphStore(redis, "t", ttl_s=100)
    data = hashing.encode(graph)
    ref = hashing.digest(data)
    store.put("alice", ref, graph, data)
    return redis, store, graph, data, ref


def test_the_graph_store_keeps_graphs_by_ref_with_a_refreshed_ttl(stored):
    redis, store, graph, data, ref = stored
    key = keys.graph_key("t", "alice", ref)
    assert redis.get(key) == data and 0 < redis.ttl(key) <= 100
    redis.expire(key, 5)
    assert store.get("alice", ref) is graph and redis.ttl(key) > 5  # an LRU hit refreshes the TTL
    other = GraphStore(redis, "t", ttl_s=100)  # another process: read from Redis, decoded, checked
    assert other.get("alice", ref) == graph
    redis.delete(key)
    assert GraphStore(redis, "t", ttl_s=100).get("alice", ref) is None
    assert store.get("alice", ref) is graph and redis.get(key) == data  # still held here: stored again
    redis.set(keys.graph_key("t", "alice", "0" * 64), data)  # bytes that do not hash to their key are not a graph
    assert GraphStore(redis, "t", ttl_s=100).get("alice", "0" * 64) is None


def test_a_deferred_store_refreshes_a_held_graph_after_the_job_and_stores_a_lost_one_again(stored):
    """A worker's store (deferred): an LRU hit costs no round trip; refresh_due() (the reaper's, after the job)
    refreshes it to the TTL plus refresh_s, at most once per refresh_s, and stores a key that was lost again."""
    redis, _, graph, data, ref = stored
    key = keys.graph_key("t", "alice", ref)
    store = GraphStore(redis, "t", ttl_s=100, deferred=True)
    assert store.get("alice", ref) == graph and 100 < redis.ttl(key) <= 110  # a miss: read and refreshed at once
    assert not store.pending()
    hit = store.get("alice", ref)
    assert hit is store.get("alice", ref) and not store.pending()  # refreshed less than refresh_s ago: none due
    store.refreshed.clear()
    redis.expire(key, 5)
    assert store.get("alice", ref) is hit and redis.ttl(key) <= 5 and store.pending()  # nothing sent yet
    assert store.refresh_due() == 1 and 100 < redis.ttl(key) <= 110 and not store.pending()
    store.refreshed.clear()
    redis.delete(key)
    assert store.get("alice", ref) is hit and store.refresh_due() == 1 and redis.get(key) == data
    assert store.refresh_due() == 0
    redis.delete(key)  # gone, and not held by a fresh process: unknown, as before
    assert GraphStore(redis, "t", ttl_s=100, deferred=True).get("alice", ref) is None


def test_a_deferred_refresh_that_fails_stays_due(stored):
    redis, _, graph, _, ref = stored
    store = GraphStore(redis, "t", ttl_s=100, deferred=True)
    store.get("alice", ref)
    store.refreshed.clear()
    store.get("alice", ref)
    down = fakeredis.FakeServer()
    down.connected = False  # Redis down
    store.redis = fakeredis.FakeRedis(server=down)
    with pytest.raises(redis_errors.ConnectionError):
        store.refresh_due()
    assert store.pending()
    store.redis = redis
    assert store.refresh_due() == 1


def test_a_graph_ref_is_unknown_to_another_owner_in_redis_and_in_the_lru(stored):
    redis, store, graph, _, ref = stored
    assert store.get("bob", ref) is None and GraphStore(redis, "t", ttl_s=100).get("bob", ref) is None
    assert store.resolver("bob")(ref) is None and store.resolver("alice")(ref) is graph
    assert redis.get(keys.graph_key("t", "bob", ref)) is None  # bob's miss stored nothing for him


def test_an_integer_beyond_64_bits_in_a_graph_is_bad_option_not_a_crash():
    body = (b'{"model": {"graph": {"inputs": [{"name": "x", "kind": "input"}], "nodes": [{"name": "a", "op": '
            b'"aten.neg.default", "args": [{"node": "x"}, 100000000000000000000000000]}], "outputs": [{"node": "a"}]}},'
            b' "inputs": [[1.0]], "targets": [0]}')
    with pytest.raises(SpecError) as err:  # JSON integers are unbounded; hashing the graph must not overflow
        prepare(msgspec.json.decode(body, type=GradientRequest), CONFIG)
    assert err.value.code == "bad_option" and "64-bit" in err.value.message


def test_a_recurrent_language_model_passes_the_numerical_check_and_has_a_memory_row():
    model, x, y, loss = CASES["lstm_lm"](torch.float32)  # token ids: the request's dtype is float32
    result = compute(request(model, x, y, loss, numcheck="sampled", numcheck_samples=3), CONFIG)
    assert close(grads(result), local_gradients(model, x, y, loss), 1e-4)
    assert result.numcheck.passed
    rnn = next(row for row in result.memory.layers if row.name == "rnn")
    assert rnn.type == "LSTM" and rnn.saved_bytes > 0
    assert rnn.output_shape == [3, 5, 6]  # the output sequence, not h_n or c_n


class _Last(nn.Module):
    """A linear layer whose output goes through `last` (detach, argmax, a comparison) before it is returned."""

    def __init__(self, last) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.last = last

    def forward(self, x):
        return self.last(self.lin(x))


class _NoGradHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        with torch.no_grad():
            return self.lin(x)


@pytest.mark.parametrize("model, why", [
    (_Last(lambda t: t.detach()), "does not depend on any parameter"),
    (_NoGradHead(), "does not depend on any parameter"),
    (_Last(lambda t: t.argmax(-1)), "dtype int64"),
    (_Last(lambda t: t > 0), "dtype bool"),
])
def test_a_first_output_without_a_gradient_is_refused_on_meta_as_no_gradient(model, why):
    x, y = torch.randn(2, 3, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64)
    req = request(model.double(), x, y, "mse")
    for check in (lambda: prepare(req, CONFIG, "meta"), lambda: estimate(req, CONFIG)):
        with pytest.raises(SpecError) as err:
            check()
        assert err.value.code == "no_gradient" and why in err.value.message, err.value.message


def _chain_request(n: int) -> GradientRequest:
    nodes = [{"name": "n0", "op": "aten.linear.default", "args": [{"node": "x"}, {"node": "w"}]}]
    nodes += [{"name": f"n{i}", "op": "aten.tanh.default", "args": [{"node": f"n{i - 1}"}]} for i in range(1, n)]
    graph = {"inputs": [{"name": "x", "kind": "input", "dtype": "float32", "shape": [-1, 3]},
                        {"name": "w", "kind": "parameter", "target": "w", "dtype": "float32", "shape": [4, 3]}],
             "nodes": nodes, "outputs": [{"node": nodes[-1]["name"]}], "dtype": "float32"}
    body = {"model": {"graph": graph, "weights": {"w": {"dtype": "float32", "shape": [4, 3], "data": [[0.1] * 3] * 4}}},
            "inputs": [[0.1, 0.2, 0.3]] * 2, "targets": [[0.0] * 4] * 2, "loss": "mse", "options": {"numcheck": "off"}}
    return msgspec.json.decode(msgspec.json.encode(body), type=GradientRequest)


def test_a_graph_over_the_node_budget_is_too_large_before_any_node_runs():
    from gradsvc.runtime.settings import Settings
    from gradsvc.engine import config_from_settings

    config = config_from_settings(Settings())
    assert config.limits.max_graph_nodes == 20_000  # up to 12 s of API CPU for the costliest op, once per graph
    with pytest.raises(SpecError) as err:
        prepare(_chain_request(20_001), config, "meta")
    assert err.value.code == "too_large" and err.value.detail["limit"] == 20_000, err.value.message
    prepare(_chain_request(50), config_from_settings(Settings(max_graph_nodes=50)), "meta")
    with pytest.raises(SpecError):
        prepare(_chain_request(51), config_from_settings(Settings(max_graph_nodes=50)), "meta")
