"""Every curl example in the README runs as written against a live stack and answers without error."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def curl_examples() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if b.lstrip().startswith("curl ")]


def test_the_readme_has_a_curl_example_per_option():
    text = "\n".join(curl_examples())
    for option in ("losses", "input_grad", "hvp", "per_sample", "micro_batch", "freeze", "checkpoint_segments",
                   "graph", "directional", "timing_repeat", "/estimate", "wait=0", "exact", "shards"):
        assert option in text, option


@pytest.mark.parametrize("example", curl_examples(), ids=lambda b: b.split("\n")[0][:60])
def test_readme_curl_example_runs_as_written(example, stack):
    command = example.replace("http://127.0.0.1:8000", stack.base_url)
    for name, value in stack.auth_headers().items():
        command = command.replace("curl -s", f"curl -s -H '{name}: {value}'", 1)
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert "error" not in body, body
    assert body.get("status") in ("finished", "queued", "started", None), body  # a 202 says what the job is doing
