"""Any nn.Module through the SDK, the API, Redis and a real worker: exported graphs as model specs.

Every gradient is compared with local autograd (float32: within 1e-4 of the tensor's largest gradient;
float64: 1e-10), the float64 numerical check must pass, and memory comes back by module path. Step
two of a loop sends graph_ref, weights and the batch, no graph. Hostile graphs get a coded 4xx before
the queue: no job is created for them.
"""

from __future__ import annotations

import copy

import httpx
import msgspec
import pytest
import redis
import torch
from torch import nn
from torch.nn import functional as F

from gradclient.errors import BadTensorError, UnsupportedModuleError
from gradclient.export import export_graph

from tests.support.models import CASES, local_gradients

pytestmark = pytest.mark.timeout(600)


class Recorder(httpx.HTTPTransport):
    """The SDK's real transport, keeping each POST body it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.posts: list[tuple[str, bytes]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.posts.append((request.url.path, request.read()))
        return super().handle_request(request)


@pytest.fixture()
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture()
def client(stack, recorder):
    with stack.sdk_client(transport=recorder) as c:
        yield c


def rq_jobs(stack) -> int:
    r = redis.Redis.from_url(stack.redis.url)
    try:
        return sum(1 for _ in r.scan_iter("rq:job:*"))
    finally:
        r.close()


def assert_close(got: dict, want: dict, tol: float) -> None:
    """Each tensor within tol of its largest gradient; a tensor whose gradient is zero (a bias in front of
    BatchNorm: both sides hold rounding noise) within tol of a thousandth of the model's largest."""
    assert set(got) == set(want)
    model_scale = max(float(g.abs().max()) for g in want.values())
    for name, g in want.items():
        scale = max(float(g.abs().max()), 1e-3 * model_scale, 1e-30)
        err = float((got[name].to(g.dtype) - g).abs().max())
        assert err <= tol * scale, f"{name}: max error {err:.3g} against scale {scale:.3g}"


def module_paths(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_modules()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", list(CASES))
def test_any_model_gradients_match_local_autograd(client, case, dtype):
    model, x, y, loss = CASES[case](dtype)
    want = local_gradients(model, x, y, loss)
    before = {n: b.clone() for n, b in model.named_buffers()}
    float64 = dtype == torch.float64
    # The float64 check perturbs 3 elements of every tensor: exact over ~1000 parameters would take a
    # minute per model on a loaded 2-core machine (tests/gradsvc/engine checks exact mode on graphs).
    result = client.gradients(model, x, y, loss=loss, numcheck="sampled" if float64 else "off", numcheck_samples=3,
                              update_buffers=False)
    assert_close(result.gradients, want, 1e-10 if float64 else 1e-4)
    assert result.dtype == str(dtype).removeprefix("torch.")
    assert result.graph_ref and len(result.graph_ref) == 64
    for name, b in model.named_buffers():  # update_buffers=False: the step's statistics stay in result.buffers
        assert torch.equal(b, before[name]), name
    rows = result.memory.layers
    assert rows and result.memory.saved_bytes_total > 0
    assert {r.name for r in rows} <= module_paths(model), [r.name for r in rows]
    assert sum(r.parameter_bytes for r in rows) > 0
    if float64:
        check = result.numcheck
        assert check.passed and check.mode == "sampled", (check.max_rel_error, check.per_parameter)
        assert set(check.per_parameter) == set(want)


def test_set_grads_writes_the_module_s_own_parameters(client):
    model, x, y, loss = CASES["prenorm_block"](torch.float32)
    want = local_gradients(model, x, y, loss)
    client.gradients(model, x, y, loss=loss, numcheck="off", memory=False).set_grads(model)
    assert_close({n: p.grad for n, p in model.named_parameters()}, want, 1e-4)


def test_step_two_sends_no_graph_and_uses_the_new_weights(client, recorder, stack):
    model, x, y, loss = CASES["transformer_encoder"](torch.float32)
    first = client.gradients(model, x, y, loss=loss, numcheck="off")
    with torch.no_grad():  # an optimizer step: new weights, same structure
        for name, p in model.named_parameters():
            p.sub_(0.1 * first.gradients[name])
    second = client.gradients(model, x, y, loss=loss, numcheck="off")
    assert_close(second.gradients, local_gradients(model, x, y, loss), 1e-4)
    assert second.graph_ref == first.graph_ref
    (_, body1), (_, body2) = recorder.posts[-2:]
    spec1 = msgspec.msgpack.decode(body1)["model"]
    spec2 = msgspec.msgpack.decode(body2)["model"]
    assert "graph" in spec1 and "graph_ref" not in spec1
    assert "graph" not in spec2 and spec2["graph_ref"] == first.graph_ref
    graph_bytes = len(msgspec.msgpack.encode(spec1["graph"]))
    assert len(body2) < len(body1) - graph_bytes + 200
    print(f"\nstep one {len(body1)} B (graph {graph_bytes} B), step two {len(body2)} B")


async def test_the_async_client_sends_graph_then_ref(stack):
    from gradclient import AsyncClient

    recorder = Recorder()
    model, x, y, loss = CASES["unet_skip"](torch.float32)
    async with AsyncClient(stack.base_url, api_key=stack.api_key, timeout=300,
                           transport=AsyncRecorder(recorder)) as client:
        first = await client.gradients(model, x, y, loss=loss, numcheck="off")
        job = await client.submit(model, x, y, loss=loss, numcheck="off")
        second = await job.result(timeout=300)
    sent = [msgspec.msgpack.decode(b)["model"] for _, b in recorder.posts]
    assert [("graph" in s, "graph_ref" in s) for s in sent] == [(True, False), (False, True)]
    assert second.graph_ref == first.graph_ref
    assert_close(second.gradients, local_gradients(model, x, y, loss), 1e-4)


class AsyncRecorder(httpx.AsyncHTTPTransport):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.recorder.posts.append((request.url.path, await request.aread()))
        return await super().handle_async_request(request)


def test_a_batch_of_another_size_reuses_the_export(client, recorder):
    model, x, y, loss = CASES["unet_skip"](torch.float32)
    client.gradients(model, x, y, loss=loss, numcheck="off")
    x3, y3 = torch.cat([x, x[:1]]), torch.cat([y, y[:1]])
    result = client.gradients(model, x3, y3, loss=loss, numcheck="off")
    assert "graph_ref" in msgspec.msgpack.decode(recorder.posts[-1][1])["model"]
    assert_close(result.gradients, local_gradients(model, x3, y3, loss), 1e-4)


def test_an_unknown_graph_ref_is_resent_once_with_the_graph(client, recorder):
    model, x, y, loss = CASES["unet_skip"](torch.float32)
    client.gradients(model, x, y, loss=loss, numcheck="off")
    for entry in client._exports.values():  # as if the service had forgotten it (TTL, a new Redis)
        entry.ref = "0" * 64
    n = len(recorder.posts)
    result = client.gradients(model, x, y, loss=loss, numcheck="off")
    sent = [msgspec.msgpack.decode(b)["model"] for _, b in recorder.posts[n:]]
    assert [("graph_ref" in s, "graph" in s) for s in sent] == [(True, False), (False, True)]
    assert result.graph_ref != "0" * 64
    assert_close(result.gradients, local_gradients(model, x, y, loss), 1e-4)


def test_unknown_graph_ref_is_a_422_telling_to_resend(http, stack):
    jobs = rq_jobs(stack)
    body = {"model": {"graph_ref": "ab" * 32, "weights": {}}, "inputs": [[1.0]], "targets": [0]}
    r = http.post("/gradients", json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "graph_not_found"
    assert "model.graph" in error["message"]
    assert rq_jobs(stack) == jobs


def test_an_option_that_cannot_apply_is_refused_before_the_queue(client, stack):
    model, x, y, loss = CASES["resnet_block"](torch.float32)  # batch norm in training mode
    jobs = rq_jobs(stack)
    for options in ({"micro_batch": 2}, {"per_sample": "norms"}):
        with pytest.raises(Exception) as err:
            client.gradients(model, x, y, loss=loss, numcheck="off", **options)
        assert err.value.code == "bad_option", err.value
        assert "bn1" in str(err.value)
    with pytest.raises(Exception) as err:
        client.gradients(model, x, y, loss=loss, numcheck="off", checkpoint_segments=2)
    assert err.value.code == "bad_option"
    assert rq_jobs(stack) == jobs


def test_token_ids_beyond_the_embedding_are_a_422_before_the_queue(client, stack):
    model, x, y, loss = CASES["hf_llama"](torch.float32)
    jobs = rq_jobs(stack)
    with pytest.raises(BadTensorError) as err:
        client.gradients(model, x + 16, y, loss=loss, numcheck="off")
    assert "[0, 15]" in str(err.value)
    assert rq_jobs(stack) == jobs


def test_shards_split_a_graph_s_batch_exactly_or_are_refused(client, stack):
    model, x, y, loss = CASES["prenorm_block"](torch.float64)
    x4, y4 = torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])
    whole = client.gradients(model, x4, y4, loss=loss, numcheck="off")
    sharded = client.gradients(model, x4, y4, loss=loss, numcheck="off", shards=2)
    assert sharded.shards is not None and sharded.shards.count == 2
    assert_close(sharded.gradients, whole.gradients, 1e-10)
    bn, bx, by, bloss = CASES["resnet_block"](torch.float32)
    jobs = rq_jobs(stack)
    with pytest.raises(Exception) as err:
        client.gradients(bn, bx, by, loss=bloss, numcheck="off", shards=2)
    assert err.value.code == "bad_option" and "bn1" in str(err.value)
    assert rq_jobs(stack) == jobs


def test_micro_batch_and_per_sample_mean_the_same_for_a_graph(client):
    model, x, y, loss = CASES["prenorm_block"](torch.float64)
    full = client.gradients(model, x, y, loss=loss, numcheck="off")
    micro = client.gradients(model, x, y, loss=loss, numcheck="off", micro_batch=1, per_sample="full")
    assert micro.micro_batches == 2
    assert_close(micro.gradients, full.gradients, 1e-10)
    for i in range(x.shape[0]):
        one = local_gradients(model, x[i:i + 1], y[i:i + 1], loss)
        assert_close({n: g[i] for n, g in micro.per_sample.gradients.items()}, one, 1e-10)


def test_the_other_options_apply_to_a_graph(client):
    model, x, y, loss = CASES["unet_skip"](torch.float64)
    frozen = ["enc.weight", "enc.bias"]
    result = client.gradients(model, x, y, loss=loss, numcheck="sampled", freeze=frozen, input_grad=True,
                              hvp={"vector": "random", "seed": 1}, graph=True, timing_repeat=2)
    assert result.numcheck.passed and result.numcheck.mode == "sampled"
    assert all(result.gradients[n] is None for n in frozen)
    xg = x.clone().requires_grad_(True)
    m = copy.deepcopy(model)
    value = nn.functional.mse_loss(m(xg), y)
    assert torch.allclose(result.input_gradient, torch.autograd.grad(value, xg)[0], atol=1e-12)
    assert set(result.hvp) >= {"dec.weight", "up.weight"}
    assert result.graph and result.graph[0].name == "MseLossBackward0"
    assert result.timings.forward_ms > 0
    estimate = client.estimate(model, x, y, loss=loss)
    assert estimate.parameter_count == sum(p.numel() for p in model.parameters())
    assert {r.name for r in estimate.memory.layers} <= module_paths(model)


def test_several_losses_on_a_graph(client):
    model, x, y, loss = CASES["prenorm_block"](torch.float64)
    losses = [{"name": "a", "type": "cross_entropy", "target": "y"},
              {"name": "b", "type": "cross_entropy", "target": "y", "weight": 0.5}]
    result = client.gradients(model, x, {"y": y}, losses=losses, numcheck="off")
    assert set(result.per_loss_gradients) == {"a", "b"}
    assert_close(result.gradients, {n: 1.5 * g for n, g in local_gradients(model, x, y, loss).items()}, 1e-10)


def test_a_module_export_cannot_capture_goes_as_recorded_and_one_whose_forward_fails_raises_its_error(client):
    class LeavesTorch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(torch.from_numpy(x.detach().numpy()))  # through numpy: export cannot follow it

    class Fails(LeavesTorch):
        def forward(self, x):
            raise RuntimeError("a bug in forward")

    torch.manual_seed(0)
    model, x, y = LeavesTorch(), torch.randn(2, 4), torch.tensor([0, 1])
    result = client.gradients(model, x, y, numcheck="off")
    assert result.capture == "trace"
    F.cross_entropy(model(x), y).backward()
    assert torch.allclose(torch.as_tensor(result.gradients["fc.weight"]), model.fc.weight.grad, atol=1e-6)
    with pytest.raises(UnsupportedModuleError) as err:
        client.gradients(Fails(), x, y)
    assert "a bug in forward" in str(err.value)


def test_control_flow_on_values_is_captured_as_this_call_ran_it(client):
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            if x.sum() > 0:  # control flow on values: specialised to the branch this batch takes
                return self.fc(x)
            return -self.fc(x)

    torch.manual_seed(0)
    model, y = DataDependent(), torch.tensor([0, 1])
    for x in (torch.randn(2, 4).abs(), -torch.randn(2, 4).abs()):  # one batch per branch
        result = client.gradients(model, x, y, numcheck="off")
        assert result.capture == "trace"
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert torch.allclose(torch.as_tensor(result.gradients["fc.weight"]), model.fc.weight.grad, atol=1e-6)


# --- hostile graphs over HTTP: a coded 4xx before the queue ---------------------------------------------

class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * 2.0


def tiny_body() -> dict:
    torch.manual_seed(0)
    model = Tiny()
    exported = export_graph(model, (torch.randn(2, 3),))
    graph = msgspec.to_builtins(exported.graph)
    weights = {n: {"dtype": "float32", "shape": list(t.shape), "data": t.tolist()} for n, t in exported.weights.items()}
    return {"model": {"graph": graph, "weights": weights}, "inputs": [[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]],
            "targets": [0, 1], "loss": "cross_entropy", "options": {"numcheck": "off"}}


def _node(body: dict, op_part: str) -> dict:
    return next(n for n in body["model"]["graph"]["nodes"] if op_part in n["op"])


def _set_op(op: str, args=None):
    def fn(b):
        node = _node(b, "linear")
        node["op"] = op
        if args is not None:
            node["args"] = args
    return fn


def _first_user_input(b) -> str:
    return next(i["name"] for i in b["model"]["graph"]["inputs"] if i["kind"] == "input")


def _cycle(b):
    nodes = b["model"]["graph"]["nodes"]
    nodes[0]["args"][0] = {"node": nodes[-1]["name"]}


def _dangling(b):
    _node(b, "tanh")["args"][0] = {"node": "no_such_node"}


def _forward_ref(b):
    nodes = b["model"]["graph"]["nodes"]
    nodes[0]["args"][0] = {"node": nodes[1]["name"]}


def _arity(b):
    _node(b, "tanh")["args"] = [{"node": _first_user_input(b)}, 1, 2, 3]


def _malformed(b):
    _node(b, "mul")["args"][1] = {"float": "lots"}


def _oversize(op: str):
    def fn(b):
        node = _node(b, "mul")  # a (2, 2) tensor, broadcast to 4e10 elements, then made real by `op`
        b["model"]["graph"]["nodes"] += [
            {"name": "huge", "op": "aten.expand.default", "args": [{"node": node["name"]}, [100_000, 100_000, 2, 2]]},
            {"name": "huge_copy", "op": op, "args": [{"node": "huge"}, *([1.0] if "add" in op else [])]}]
    return fn


def _many_nodes(b):
    graph = b["model"]["graph"]
    last = graph["outputs"][0]["node"]
    for i in range(100_000):
        graph["nodes"].append({"name": f"n{i}", "op": "aten.neg.default", "args": [{"node": last}]})
        last = f"n{i}"
    graph["outputs"] = [{"node": last}]


def _unknown_weight(b):
    weights = b["model"]["weights"]
    weights["fc.not_a_weight"] = weights.pop("fc.weight")


def _missing_weight(b):
    b["model"]["weights"].pop("fc.bias")


def _empty_graph(b):
    graph = b["model"]["graph"]
    graph["nodes"], graph["outputs"] = [], []


HOSTILE = {
    "unknown_op": (_set_op("aten.totally_made_up.default"), {"unsupported_op"}),
    "from_file": (_set_op("aten.from_file.default", ["/etc/passwd", False, 10]), {"unsupported_op"}),
    "a_python_callable": (_set_op("builtins.eval", ["1"]), {"unsupported_op"}),
    "empty_graph": (_empty_graph, {"bad_option", "invalid_body"}),
    "cycle": (_cycle, {"bad_option"}),
    "dangling_reference": (_dangling, {"bad_option"}),
    "forward_reference": (_forward_ref, {"bad_option"}),
    "wrong_arity": (_arity, {"bad_option"}),
    "malformed_argument": (_malformed, {"bad_option", "invalid_body"}),
    "oversize_intermediates": (_oversize("aten.add.Tensor"), {"too_large"}),
    "oversize_contiguous_copy": (_oversize("aten.contiguous.default"), {"too_large"}),
    "100000_nodes": (_many_nodes, {"too_large"}),
    "unknown_weight_name": (_unknown_weight, {"bad_weights"}),
    "missing_weight": (_missing_weight, {"bad_weights"}),
}


@pytest.fixture(scope="module")
def tiny() -> dict:
    return tiny_body()


def test_the_tiny_graph_itself_is_accepted(http, tiny):
    r = http.post("/gradients", json=tiny)
    assert r.status_code == 200, r.text
    assert set(r.json()["gradients"]) == {"fc.weight", "fc.bias"}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_graph_gets_a_coded_4xx_before_the_queue(http, stack, tiny, name):
    mutate, codes = HOSTILE[name]
    body = copy.deepcopy(tiny)
    mutate(body)
    jobs = rq_jobs(stack)
    r = http.post("/gradients", json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["code"] in codes, error
    assert len(error["message"]) > 20
    assert rq_jobs(stack) == jobs  # nothing was queued, so no worker ran it


def test_a_graph_ref_over_http_answers_as_the_graph_did(http, tiny):
    first = http.post("/gradients", json=tiny)
    ref = first.json()["graph_ref"]
    body = {**tiny, "model": {"graph_ref": ref, "weights": tiny["model"]["weights"]}}
    second = http.post("/gradients", json=body)
    assert second.status_code == 200, second.text
    assert second.json()["gradients"] == first.json()["gradients"]
    assert second.json()["graph_ref"] == ref
