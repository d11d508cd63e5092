"""prepare() is called from the API's thread pool: its caches must hold under 8 threads at once."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

from gradsvc.engine import Engine, EngineConfig
from gradsvc.engine.spec import Limits, build
from gradsvc.lru import LRU
from gradsvc.wire import GradientRequest


def spec(width: int, batch: int, seed: int) -> GradientRequest:
    layers = [{"type": "Linear", "in_features": 6, "out_features": width}, {"type": "Tanh"},
              {"type": "Linear", "in_features": width, "out_features": 3}]
    body = {"model": {"layers": layers, "dtype": "float32", "seed": seed}, "inputs": [[0.5] * 6] * batch,
            "targets": [0] * batch, "options": {"numcheck": "off"}}
    return msgspec.convert(body, GradientRequest)


@pytest.fixture()
def tiny_caches(monkeypatch):
    """Caches far smaller than the working set, so threads evict entries others are reading."""
    engine = Engine(EngineConfig(init_cache_bytes=500))  # caches the two smallest states only
    engine.caches.output_shapes = LRU(3)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    yield engine
    sys.setswitchinterval(old)


def test_prepare_from_8_threads_with_distinct_and_repeated_specs(tiny_caches):
    engine = tiny_caches
    # 12 specs (4 widths x 3 batch sizes), each asked for again and again; seeds differ per width.
    cases = [(w, b, w) for w in (4, 5, 7, 9) for b in (1, 2, 3)]
    expected = {}
    for w, _, seed in cases:
        torch.manual_seed(seed)
        expected[w] = build(spec(w, 1, seed).model.layers, limits=Limits()).state_dict()

    def hammer(thread: int) -> int:
        done = 0
        for i in range(60):
            w, b, seed = cases[(thread * 5 + i) % len(cases)]
            device = "cpu" if i % 3 == 0 else "meta"  # the worker's path (initial state) and the API's
            prep = engine.prepare(spec(w, b, seed), device)
            assert prep.output_shape == [b, 3] and list(prep.inputs.first.shape) == [b, 6]
            assert [list(p.shape) for p in prep.model.parameters()] == [[w, 6], [w], [3, w], [3]]
            if device == "cpu":  # the seeded initial weights, not another thread's draw
                for name, t in prep.model.state_dict().items():
                    assert torch.equal(t, expected[w][name]), (w, name)
            done += 1
        return done

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(hammer, range(8))) == 8 * 60  # any exception in a thread re-raises here
    assert len(engine.caches.output_shapes) <= 3
