"""Engine side: refusals happen before the queue, labels say they must be integers, and the
result's figures are what their names say (integer byte counts, timings of phases that ran)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gradsvc.engine import EngineConfig, SpecError, compute, prepare
from gradsvc.wire import GradientRequest, GradientResult

from tests.support.nets import SEED_A_LAYERS, seed_a_batch, tensor_json


def request(layers=SEED_A_LAYERS, x=None, y=None, **options) -> GradientRequest:
    bx, by = seed_a_batch(4)
    x = bx if x is None else x
    y = by if y is None else y
    body = {"model": {"layers": layers, "dtype": "float64", "seed": 0}, "inputs": tensor_json(x),
            "targets": tensor_json(y), "options": {"numcheck": "off", **options}}
    return msgspec.convert(body, GradientRequest)


# item 1: per_sample with BatchNorm used to pass validation and fail in the worker
def test_per_sample_with_batch_norm_is_refused_on_the_meta_device_before_queueing():
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "BatchNorm1d", "num_features": 8},
              {"type": "Linear", "in_features": 8, "out_features": 3}]
    with pytest.raises(SpecError) as info:
        prepare(request(layers, per_sample="norms"), EngineConfig(), "meta")
    assert info.value.code == "bad_option"
    assert "layer 1 (BatchNorm1d)" in info.value.message and "per_sample='off'" in info.value.message


# item 5: float class labels with cross_entropy were told "expected shape [4, 3]"
@pytest.mark.parametrize("loss", ["cross_entropy", "nll"])
def test_float_class_labels_are_told_to_be_integers(loss):
    x, y = seed_a_batch(4)
    req = request(y=y.to(torch.float32))
    req.loss = loss
    with pytest.raises(SpecError) as info:
        prepare(req, EngineConfig(), "meta")
    message = info.value.message
    assert info.value.code == "bad_target"
    assert "class indices must be integers" in message and "float32" in message and "int64" in message
    assert "torch.float" not in message  # dtype names as the wire writes them


def test_float_class_probabilities_shaped_like_the_output_still_work():
    x, y = seed_a_batch(4)
    probs = torch.nn.functional.one_hot(y, 3).to(torch.float64)
    assert compute(request(y=probs)).loss > 0


# item 8: the checkpoint block's byte counts came back as floats (3168.0)
def test_checkpoint_byte_counts_are_integers_on_the_wire():
    layers = [{"type": "Linear", "in_features": 6, "out_features": 32}, {"type": "ReLU"},
              {"type": "Linear", "in_features": 32, "out_features": 32}, {"type": "ReLU"},
              {"type": "Linear", "in_features": 32, "out_features": 3}]
    result = compute(request(layers, checkpoint_segments=2))
    decoded = msgspec.json.decode(msgspec.json.encode(result), type=GradientResult).checkpoint
    for key in ("segments", "saved_bytes_without", "saved_bytes_with", "memory_saved_bytes"):
        assert type(decoded[key]) is int, (key, decoded[key])
    assert b'"saved_bytes_with":' in msgspec.json.encode(result) and b".0," not in \
        msgspec.json.encode(result.checkpoint).split(b'"forward_backward')[0]


# item 9: numcheck_ms and memory_ms were non-zero with both off; total_ms did not say where time went
def test_phases_that_did_not_run_take_zero_time():
    t = compute(request(memory=False)).timings
    assert t.numcheck_ms == 0.0 and t.memory_ms == 0.0
    t = compute(request(memory=True, numcheck="exact")).timings
    assert t.numcheck_ms > 0.0 and t.memory_ms > 0.0


def test_total_covers_the_phases_and_prepare_names_a_first_jobs_set_up():
    t = compute(request(memory=True, numcheck="exact")).timings  # one-off: its own caches, so prepare builds all
    phases = t.prepare_ms + t.forward_ms + t.backward_ms + t.memory_ms + t.numcheck_ms
    assert t.prepare_ms > 0 and t.total_ms >= phases
    assert set(msgspec.structs.asdict(t)) == {"queue_ms", "prepare_ms", "forward_ms", "backward_ms", "memory_ms",
                                              "numcheck_ms", "total_ms"}
