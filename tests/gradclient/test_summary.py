"""A result as people read it: print(result) / summary() show the per-layer table; plot() draws a PNG."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.support.nets import SEED_A_LAYERS

ROOT = Path(__file__).resolve().parents[2]
X = [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]]


def test_print_shows_each_layer_with_shape_parameters_saved_bytes_and_share_then_the_check_and_timings(client):
    result = client.gradients({"layers": SEED_A_LAYERS, "dtype": "float64"}, X, [0, 2], numcheck="exact")
    text = str(result)
    assert text == result.summary()
    rows = {line.split()[0]: line for line in text.splitlines() if line[:1].isdigit()}
    assert set(rows) == {"0", "1", "2"}
    # Linear(6, 8): output [2, 8], 56 parameters, saves its 96-byte input; Tanh saves its 128-byte output.
    assert "[2, 8]" in rows["0"] and " 56 " in rows["0"] and "96 B" in rows["0"]
    assert "128 B" in rows["1"] and "57.1%" in rows["1"]
    assert "Saved for backward: 224 B" in text
    assert "Parameters: 83 (float64)" in text
    assert "Numerical check (exact, float64, 166 evaluations): passed" in text
    assert "Timings (ms): queue" in text


def test_a_result_whose_check_did_not_run_says_off_not_failed(client):
    result = client.gradients({"layers": SEED_A_LAYERS, "dtype": "float64"}, X, [0, 2], numcheck="off")
    assert result.numcheck.mode == "off" and result.numcheck.passed is None
    assert "Numerical check: off (the gradients were not checked)" in str(result) and "FAILED" not in str(result)


@pytest.mark.slow  # tests/gradclient/test_examples.py runs the same example as a script (table and chart)
def test_the_example_prints_the_table_and_saves_a_png(stack, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("summary_example", ROOT / "examples" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "result.png"
    result = module.main(stack.base_url, str(out), verbose=True)
    printed = capsys.readouterr().out
    assert "Layer (type)" in printed and "Conv2d" in printed and f"saved {out}" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert result.memory.layers[0].output_shape == [32, 8, 28, 28]
