"""The SDK against the real stack: gradients equal local autograd; submit, result, cancel, estimate, async."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradclient import AsyncClient, CanceledError, Client, Estimate, Memory, Numcheck, Residual, Timings


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6, 3))


def residual() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), Residual(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), nn.ReLU(),
                         Residual(nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())), nn.Linear(8, 3))


def batch(kind: str, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shape = (n, 1, 8, 8) if kind == "cnn" else (n, 6)
    return torch.randn(*shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make", [mlp, cnn, residual], ids=["mlp", "cnn", "residual"])
def test_gradients_of_a_local_module_equal_local_autograd_in_float64(client, make):
    torch.manual_seed(1)
    model = make().double()
    x, y = batch(make.__name__)
    result = client.gradients(model, x, y, loss="cross_entropy", numcheck="exact")
    expected = local_grads(model, x, y)
    assert set(result.gradients) == set(expected)
    for name, g in expected.items():
        got = result.gradients[name]
        assert got.dtype == torch.float64 and got.shape == g.shape, name
        assert torch.allclose(got, g, rtol=0, atol=1e-10), name
    assert result.loss == pytest.approx(F.cross_entropy(model(x), y).item(), abs=1e-12)
    assert isinstance(result.numcheck, Numcheck) and result.numcheck.passed
    assert isinstance(result.memory, Memory) and isinstance(result.timings, Timings)
    assert result.parameter_count == sum(p.numel() for p in model.parameters())


def test_json_transport_gives_the_same_gradients_as_msgpack(stack, client):
    torch.manual_seed(2)
    model = residual().double()
    x, y = batch("residual")
    packed = client.gradients(model, x, y, numcheck="off")
    with Client(stack.base_url, wire_format="json") as json_client:
        plain = json_client.gradients(model, x, y, numcheck="off")
    for name, g in packed.gradients.items():
        assert torch.equal(plain.gradients[name], g), name


def test_named_children_frozen_parameters_and_numpy_inputs_use_the_local_names(client):
    torch.manual_seed(3)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(6, 4), act=nn.Tanh(), fc2=nn.Linear(4, 3))).double()
    model.fc1.bias.requires_grad_(False)
    x, y = batch("mlp")
    result = client.gradients(model, x.numpy(), y.numpy(), numcheck="off", memory=False)
    expected = local_grads(model, x, y)
    assert result.gradients["fc1.bias"] is None
    for name in ("fc1.weight", "fc2.weight", "fc2.bias"):
        assert torch.allclose(result.gradients[name], expected[name], rtol=0, atol=1e-12), name
    result.set_grads(model)
    assert torch.equal(model.fc2.weight.grad, result.gradients["fc2.weight"])


def test_a_spec_dict_model_with_nested_list_inputs_and_per_sample_norms(client):
    spec = {"layers": [{"type": "Linear", "in_features": 6, "out_features": 3}], "dtype": "float64", "seed": 0}
    x, y = batch("mlp", 4)
    result = client.gradients(spec, x.tolist(), y.tolist(), per_sample="norms", input_grad=True, numcheck="off")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3)).double()
    assert torch.allclose(result.gradients["0.weight"], local_grads(model, x, y)["0.weight"], rtol=0, atol=1e-12)
    assert result.per_sample.norms.shape == (4,)
    assert result.input_gradient.shape == (4, 6)


def slow_request() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """About 19k parameters, checked exactly in float64: seconds of finite differences on a CPU worker."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(120, 120), nn.Tanh(), nn.Linear(120, 36)).double()
    g = torch.Generator().manual_seed(5)
    return model, torch.randn(64, 120, generator=g, dtype=torch.float64), torch.randint(0, 36, (64,), generator=g)


def test_submit_returns_a_job_whose_result_shows_progress_and_matches_autograd(client, capsys):
    torch.manual_seed(6)
    model = mlp().double()
    x, y = batch("mlp")
    job = client.submit(model, x, y, numcheck="off")
    assert job.status() in ("queued", "started", "finished")
    result = job.result(timeout=60, progress=True)
    assert job.status() == "finished" and result.job_id == job.id
    expected = local_grads(model, x, y)
    for name, g in expected.items():
        assert torch.allclose(result.gradients[name], g, rtol=0, atol=1e-12), name
    assert "finished" in capsys.readouterr().err  # the bar's last phase


def test_cancel_stops_a_queued_job_at_once_and_a_running_one_at_its_next_step(client):
    model, x, y = slow_request()
    running = client.submit(model, x, y, numcheck="exact")
    queued = client.submit(model, x, y, numcheck="exact")  # one worker: this one waits
    assert queued.cancel() == "canceled"
    with pytest.raises(CanceledError):
        queued.result(timeout=5)
    for _ in range(200):
        if running.status() == "started":
            break
        time.sleep(0.02)
    running.cancel()
    with pytest.raises(CanceledError) as info:
        running.result(timeout=30)
    assert info.value.job_id == running.id
    assert running.status() == "canceled"


def test_estimate_predicts_parameters_and_memory_without_queueing(client):
    model = cnn().double()
    x, y = batch("cnn")
    est = client.estimate(model, x, y)
    assert isinstance(est, Estimate)
    assert est.parameter_count == sum(p.numel() for p in model.parameters())
    assert [layer.name for layer in est.memory.layers] == [str(i) for i in range(len(model))]
    assert est.memory.saved_bytes_total == sum(layer.saved_bytes for layer in est.memory.layers)


def test_layers_and_health(client):
    names = {layer.type for layer in client.layers()}
    assert {"Linear", "Conv2d", "MaxPool2d", "Flatten", "Sequential", "Residual"} <= names
    assert client.health() == {"status": "ok"}
    assert client.health(ready=True)["workers"] >= 1


def test_async_client_has_the_same_methods(stack):
    torch.manual_seed(8)
    model = residual().double()
    x, y = batch("residual")
    expected = local_grads(model, x, y)

    async def go():
        async with AsyncClient(stack.base_url) as ac:
            direct, job = await asyncio.gather(ac.gradients(model, x, y, numcheck="off"),
                                               ac.submit(model, x, y, numcheck="off"))
            queued = await job.result(timeout=60)
            est = await ac.estimate(model, x, y)
            return direct, queued, await job.status(), est, await ac.health(ready=True), await ac.layers()

    direct, queued, status, est, health, layers = asyncio.run(go())
    for result in (direct, queued):
        for name, g in expected.items():
            assert torch.allclose(result.gradients[name], g, rtol=0, atol=1e-10), name
    assert status == "finished" and health["status"] == "ready" and layers
    assert est.parameter_count == direct.parameter_count


def test_numpy_results_without_torch_on_the_client_side(client, monkeypatch):
    from gradclient import tensors

    x, y = batch("mlp", 4)
    spec = {"layers": [{"type": "Linear", "in_features": 6, "out_features": 3}], "dtype": "float64"}
    monkeypatch.setattr(tensors, "torch", None)
    result = client.gradients(spec, x.numpy(), y.numpy(), numcheck="off")
    assert isinstance(result.gradients["0.weight"], np.ndarray) and result.gradients["0.weight"].shape == (3, 6)
