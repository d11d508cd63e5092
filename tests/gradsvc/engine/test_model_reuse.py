"""A CPU worker reuses the model it built for a spec (its Engine's caches.resident_models): nothing of one request may reach the
next. Each test runs a request whose state would leak (buffers a training forward changes, frozen
parameters, other weights, another seed) and then one that must equal a fresh model's answer."""

from __future__ import annotations

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from gradsvc.engine import ComputeError, Engine
from gradsvc.engine.tensors import decode
from gradsvc.wire import GradientRequest

from tests.support.nets import SEED_A_LAYERS, seed_a_batch, tensor_json

BN_LAYERS = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "BatchNorm1d", "num_features": 8},
             {"type": "Tanh"}, {"type": "Linear", "in_features": 8, "out_features": 3}]


def request(layers, x, y, weights=None, seed=0, **options) -> GradientRequest:
    model = {"layers": layers, "dtype": "float64", "seed": seed}
    if weights is not None:
        model["weights"] = {k: tensor_json(v) for k, v in weights.items()}
    body = {"model": model, "inputs": tensor_json(x), "targets": tensor_json(y), "loss": "cross_entropy",
            "options": {"numcheck": "off", "memory": False, **options}}
    return msgspec.convert(body, GradientRequest)


def grads(result) -> dict[str, torch.Tensor]:
    return {n: decode(t, where=n, max_elements=1 << 30) for n, t in result.gradients.items() if t is not None}


def local(layers_module: nn.Module, x, y) -> dict[str, torch.Tensor]:
    loss = F.cross_entropy(layers_module(x), y)
    return dict(zip([n for n, _ in layers_module.named_parameters()],
                    torch.autograd.grad(loss, list(layers_module.parameters()))))


def bn_module(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()


def test_a_second_request_of_a_spec_reuses_the_first_ones_model():
    engine = Engine()
    built, compute = engine.caches.resident_models, engine.compute
    x, y = seed_a_batch()
    compute(request(SEED_A_LAYERS, x, y))
    assert len(built) == 1
    model = built.values()[0].model
    prep = engine.prepare(request(SEED_A_LAYERS, x, y), torch.device("cpu"))
    assert prep.model is model and len(built) == 0  # checked out: no other compute can take it meanwhile


def test_buffers_a_training_forward_changed_are_reset():
    engine = Engine()
    built, compute = engine.caches.resident_models, engine.compute
    x, y = seed_a_batch(8)
    for _ in range(3):  # each request updates BatchNorm's running stats in its model
        result = compute(request(BN_LAYERS, x, y))
    assert len(built) == 1
    reused = built.values()[0].model
    assert torch.equal(reused[1].num_batches_tracked, torch.tensor(1))  # one forward's update, not three
    expected = local(bn_module(), x, y)
    for name, g in grads(result).items():
        assert torch.allclose(g, expected[name], rtol=0, atol=1e-12), name


def test_frozen_parameters_and_other_weights_do_not_carry_over():
    compute = Engine().compute
    x, y = seed_a_batch()
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    given = compute(request(SEED_A_LAYERS, x, y, weights=other.state_dict(), freeze=["0.weight"]))
    assert given.gradients["0.weight"] is None
    for name, g in grads(given).items():
        if g is not None:
            assert torch.allclose(g, local(other, x, y)[name], rtol=0, atol=1e-12), name
    for seed in (0, 3):  # then the seeded default initialisation, every parameter trainable again
        torch.manual_seed(seed)
        fresh = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        result = grads(compute(request(SEED_A_LAYERS, x, y, seed=seed)))
        for name, g in local(fresh, x, y).items():
            assert torch.allclose(result[name], g, rtol=0, atol=1e-12), (seed, name)


def test_a_failed_compute_drops_its_model():
    engine = Engine()
    built, compute = engine.caches.resident_models, engine.compute
    layers = [{"type": "Linear", "in_features": 6, "out_features": 3}]
    x, y = seed_a_batch()
    compute(request(layers, x, y))
    assert len(built) == 1
    weights = {"0.weight": torch.full((3, 6), 1e308, dtype=torch.float64), "0.bias": torch.zeros(3, dtype=torch.float64)}
    try:  # finite weights whose output overflows: the job fails non_finite after its model was checked out
        compute(request(layers, x.abs() + 1, y, weights=weights))
        raise AssertionError("expected non_finite")
    except ComputeError as exc:
        assert exc.code == "non_finite"
    assert len(built) == 0  # the failed request's model was not handed back
    result = grads(compute(request(layers, x, y)))  # a fresh one is built and gives the seeded answer
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(6, 3)).double()
    for name, g in local(fresh, x, y).items():
        assert torch.allclose(result[name], g, rtol=0, atol=1e-12), name


def test_a_pooled_model_is_loaded_in_place_unless_a_module_loads_its_own_way():
    """prepare writes a request's state into a pooled model entry by entry (Resident.slots) where every module loads
    as nn.Module does; InstanceNorm with running stats has a _load_from_state_dict of its own, so its model goes
    through load_state_dict, and either way a second request keeps nothing of the first."""
    engine = Engine()
    x, y = seed_a_batch(8)
    plain = engine.prepare(request(BN_LAYERS, x, y), torch.device("cpu"))
    assert plain.resident is not None and plain.resident[1].plain
    assert set(plain.resident[1].slots) == set(plain.model.state_dict())
    norm = [{"type": "Linear", "in_features": 6, "out_features": 8},
            {"type": "Unflatten", "dim": 1, "unflattened_size": [2, 4]},
            {"type": "InstanceNorm1d", "num_features": 2, "track_running_stats": True, "affine": True},
            {"type": "Flatten"}, {"type": "Linear", "in_features": 8, "out_features": 3}]
    own = engine.prepare(request(norm, x, y), torch.device("cpu"))
    assert own.resident is not None and not own.resident[1].plain
    torch.manual_seed(9)
    other = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in own.model.state_dict().items()}
    first, second = (grads(engine.compute(request(norm, x, y, weights=w))) for w in (other, None))
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(6, 8), nn.Unflatten(1, (2, 4)), nn.InstanceNorm1d(2, track_running_stats=True,
                                                                                      affine=True),
                          nn.Flatten(), nn.Linear(8, 3)).double()
    assert len(engine.caches.resident_models) == 1  # the second request took the first one's model from the pool
    for name, g in local(fresh, x, y).items():
        assert torch.allclose(second[name], g, rtol=0, atol=1e-12), name
        assert not torch.allclose(first[name], g), name
