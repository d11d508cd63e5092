"""The examples run against the stack with their small defaults and show what they claim."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    module = load("train_mlp")
    assert out["max_weight_diff"] <= module.WEIGHT_TOLERANCE == 1e-6


def test_federated_average_of_shard_gradients_is_the_full_batch_gradient(stack):
    out = load("federated").main(stack.base_url, verbose=False)
    assert out["first_round_diff"] < 1e-6
    assert out["losses"][-1] < out["losses"][0]


def test_a_session_loop_and_the_same_loop_with_local_gradients_end_on_the_same_weights(stack):
    module = load("train_session")
    out = module.main(stack.base_url, verbose=False)
    assert out["max_weight_diff"] <= module.WEIGHT_TOLERANCE
    assert out["session_losses"][-1] < out["session_losses"][0]
    assert all(abs(a - b) < 1e-4 for a, b in zip(out["session_losses"], out["local_losses"]))


@pytest.mark.parametrize("name", ["train_mlp", "federated", "train_session"])
def test_help_shows_the_whole_description_and_every_flag_explained(name):
    """--help shows the whole first paragraph of the description, and every flag has its help."""
    out = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=EXAMPLES.parent)
    assert out.returncode == 0, out.stderr
    doc = load(name).__doc__
    first_paragraph = " ".join(doc.split("\n\n")[0].split())
    assert first_paragraph.endswith(".") and first_paragraph in " ".join(out.stdout.split())
    flags = re.findall(r"^  (--[a-z-]+)", out.stdout, flags=re.M)
    assert len(flags) >= 3
    for line in out.stdout.splitlines():
        if re.match(r"^  --[a-z-]+ [A-Z_]+$", line):  # a flag whose help did not fit on its line follows below
            continue
        if re.match(r"^  --[a-z-]+", line):
            assert len(line.split(None, 2)) == 3, f"flag without help: {line}"


def test_the_docs_state_what_holds_for_training_with_several_workers():
    """"The same weights" does not hold with two workers (7.45e-9 apart): the SDK's page says float32 rounding."""
    page = " ".join((EXAMPLES.parent / "docs" / "sdk.md").read_text().split())
    assert "ending on the same weights as local training" not in page
    assert "float32 rounding" in page and "1e-6" in page


def test_the_summary_example_writes_its_chart_outside_the_repository(stack):
    """Without --out the chart goes into a new temporary directory, never into the working tree."""
    def pngs() -> set[Path]:
        return {*EXAMPLES.parent.glob("*.png"), *EXAMPLES.glob("*.png")}

    before = pngs()
    env = {**os.environ, "GRADSVC_API_KEY": stack.api_key} if stack.api_key else dict(os.environ)
    out = subprocess.run([sys.executable, str(EXAMPLES / "summary.py"), "--base-url", stack.base_url],
                         capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Layer (type)" in out.stdout and "Conv2d" in out.stdout  # the summary table
    saved = Path(re.search(r"^saved (.+)$", out.stdout, flags=re.M)[1])
    assert saved.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert EXAMPLES.parent not in saved.resolve().parents
    assert pngs() == before
    saved.unlink()
    saved.parent.rmdir()
