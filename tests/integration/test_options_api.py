"""Engine options through the real API: the numbers equal local PyTorch, and /estimate equals the measurement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gradsvc.engine.test_options import CNN, RESIDUAL
from tests.support.nets import SEED_A_LAYERS, from_wire, seed_a_batch, seed_a_module, tensor_json


def test_several_losses_hvp_and_input_gradient_through_the_api_equal_local(http):
    x, y = seed_a_batch(6)
    soft = torch.softmax(torch.randn(6, 3, dtype=torch.float64), 1)
    model = seed_a_module()
    vec = {n: torch.randn(p.shape, dtype=torch.float64) for n, p in model.named_parameters()}
    body = {"model": {"layers": SEED_A_LAYERS, "dtype": "float64"}, "inputs": tensor_json(x),
            "targets": {"y": tensor_json(y), "soft": tensor_json(soft)},
            "losses": [{"name": "ce", "type": "cross_entropy", "target": "y"},
                       {"name": "mse", "type": "mse", "weight": 2.0, "target": "soft"}],
            "options": {"input_grad": True, "hvp": {"vector": {n: tensor_json(v) for n, v in vec.items()}},
                        "graph": True, "encoding": "b64"}}
    r = http.post("/gradients", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    xl = x.clone().requires_grad_(True)
    params = list(model.parameters())
    logits = model(xl)
    ce, mse = F.cross_entropy(logits, y), F.mse_loss(logits, soft)
    g_ce = torch.autograd.grad(ce, params, retain_graph=True)
    total = ce + 2.0 * mse
    grads = torch.autograd.grad(total, [*params, xl], create_graph=True)
    hv = torch.autograd.grad(grads[:-1], params, grad_outputs=list(vec.values()))
    for i, (name, _) in enumerate(model.named_parameters()):
        assert torch.allclose(from_wire(out["gradients"][name]), grads[i], rtol=0, atol=1e-10)
        assert torch.allclose(from_wire(out["per_loss_gradients"]["ce"][name]), g_ce[i], rtol=0, atol=1e-10)
        assert torch.allclose(from_wire(out["hvp"][name]), hv[i], rtol=0, atol=1e-10)
    assert torch.allclose(from_wire(out["input_gradient"]), grads[-1], rtol=0, atol=1e-10)
    assert out["graph"][0]["name"] == "AddBackward0"
    assert set(out["gradient_cosine"]) == {"ce|mse"}


@pytest.mark.parametrize("layers, shape", [(SEED_A_LAYERS, (4, 6)), (CNN, (4, 1, 8, 8)), (RESIDUAL, (4, 6))],
                         ids=["mlp", "cnn", "residual"])
def test_estimate_answers_at_once_what_the_worker_then_measures(http, layers, shape):
    x, y = torch.randn(*shape, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    body = {"model": {"layers": layers, "dtype": "float64"}, "inputs": tensor_json(x), "targets": tensor_json(y),
            "options": {"numcheck": "off"}}
    predicted = http.post("/estimate", json=body)
    measured = http.post("/gradients", json=body)
    assert predicted.status_code == 200 and measured.status_code == 200, (predicted.text, measured.text)
    assert predicted.json()["memory"]["layers"] == measured.json()["memory"]["layers"]
    assert predicted.json()["memory"]["saved_bytes_total"] == measured.json()["memory"]["saved_bytes_total"]
    assert predicted.json()["parameter_count"] == measured.json()["parameter_count"]


def test_non_finite_job_fails_with_its_code_and_the_layer(http):
    layers = [{"type": "Linear", "in_features": 6, "out_features": 3}]
    body = {"model": {"layers": layers, "dtype": "float32"}, "inputs": [[1e20] * 6] * 2,
            "targets": [[0.0] * 3] * 2, "loss": "mse"}
    r = http.post("/gradients", json=body)
    assert r.status_code == 422
    out = r.json()
    assert out["error"]["code"] == "non_finite" and out["status"] == "failed"
    job = http.get(f"/jobs/{out['job_id']}").json()
    assert job["status"] == "failed" and job["error"]["code"] == "non_finite"


@pytest.mark.parametrize("spelling", ["json", "msgpack"])
def test_integer_fields_written_as_whole_floats_run_as_their_ints(http, spelling):
    """`micro_batch: 1.0` (and timing_repeat 2.0, model.seed 1.0) was queued as sent, failed
    by the worker's strict decode (400 invalid_body with a job_id and status "failed"); it runs as 1."""
    import msgspec

    x, y = seed_a_batch(4)
    body = {"model": {"layers": SEED_A_LAYERS, "dtype": "float64", "seed": 1}, "inputs": tensor_json(x),
            "targets": tensor_json(y), "options": {"numcheck": "off", "micro_batch": 1, "timing_repeat": 2}}
    want = http.post("/gradients?wait=60", json=body).json()
    body["model"]["seed"] = 1.0
    body["options"].update(micro_batch=1.0, timing_repeat=2.0)
    codec = msgspec.json if spelling == "json" else msgspec.msgpack
    r = http.post("/gradients?wait=60", content=codec.encode(body), headers={"Content-Type": f"application/{spelling}"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["status"] == "finished" and got["micro_batches"] == 4 and got["seed"] == 1
    assert got["gradients"] == want["gradients"] and got["loss"] == want["loss"]
