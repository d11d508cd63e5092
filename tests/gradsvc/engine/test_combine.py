"""Requests computed together (gradsvc/engine/combine.py) answer what each answers alone: layer specs and a graph
model, float32 and float64, several losses; a request with an option the combined run does not reproduce, or whose
values fail, is left to compute alone."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradsvc.engine import Engine
from gradsvc.wire import GradientRequest
from tests.support.combine_cases import (assert_equal_results, graph_bodies, layer_body, mse_body,
                                         overflowing_body)

CPU = torch.device("cpu")
_decode = msgspec.json.Decoder(GradientRequest)


def _request(body: dict) -> GradientRequest:
    return _decode.decode(msgspec.json.encode(body))


def _together(bodies: list[dict]) -> tuple[list[dict], list[dict | None]]:
    """(each alone, all together) as wire dicts."""
    engine = Engine()
    alone = [msgspec.to_builtins(engine.compute(_request(b), device=CPU)) for b in bodies]
    together = Engine().combine([(_request(b), None, None) for b in bodies], CPU)
    return alone, [msgspec.to_builtins(r) if r is not None else None for r in together]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("memory", [True, False])
def test_layer_specs_with_their_own_weights_and_batches_equal_alone(dtype, memory):
    bodies = [layer_body(i, dtype, {"memory": memory}) for i in range(6)]
    alone, together = _together(bodies)
    # With memory asked for, the first runs alone (metered) and the others carry its report.
    assert [t["combined"] for t in together] == ([None] + [5] * 5 if memory else [6] * 6)
    for a, t in zip(alone, together):
        assert_equal_results(a, t, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_several_losses_and_their_per_loss_gradients_equal_alone(dtype):
    bodies = [layer_body(i, dtype, {"memory": False}, losses=True) for i in range(4)]
    alone, together = _together(bodies)
    assert all(t["combined"] == 4 and t["per_loss_gradients"] for t in together)
    for a, t in zip(alone, together):
        assert_equal_results(a, t, dtype)
        assert t["losses"].keys() == a["losses"].keys()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_graph_model_equals_alone(dtype):
    bodies = graph_bodies(4, dtype)
    alone, together = _together(bodies)
    assert [t["combined"] for t in together] == [None, 3, 3, 3]
    for a, t in zip(alone, together):
        assert_equal_results(a, t, dtype)


def test_only_the_failing_request_is_left_alone():
    bodies = [mse_body(1), mse_body(2), overflowing_body(), mse_body(3), mse_body(4)]
    for b in bodies:
        b["options"]["memory"] = False
    engine = Engine()
    together = engine.combine([(_request(b), None, None) for b in bodies], CPU)
    assert [r.combined if r is not None else None for r in together] == [5, 5, None, 5, 5]
    with pytest.raises(Exception, match="non_finite|is inf"):
        engine.compute(_request(bodies[2]), device=CPU)


def test_options_it_does_not_reproduce_and_other_structures_compute_alone():
    per_sample = [layer_body(i, options={"per_sample": "norms", "memory": False}) for i in range(3)]
    checked = [layer_body(i, options={"numcheck": "auto", "memory": False}) for i in range(3)]
    lone = layer_body(9, "float32", {"memory": False})
    together = Engine().combine([(_request(b), None, None) for b in [*per_sample, *checked, lone]], CPU)
    assert together == [None] * 7
