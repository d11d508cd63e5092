"""The examples run against the stack with their small defaults and show what they claim."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_with_service_gradients_lowers_the_loss_and_matches_local_training(stack):
    out = load("train_mlp").main(stack.base_url, verbose=False)
    losses = out["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert out["max_weight_diff"] < 1e-5


def test_federated_average_of_shard_gradients_is_the_full_batch_gradient(stack):
    out = load("federated").main(stack.base_url, verbose=False)
    assert out["first_round_diff"] < 1e-6
    assert out["losses"][-1] < out["losses"][0]
