"""Every curl example and SDK snippet in the README and in every docs/*.md page runs as written against a
live stack, and the figures each page prints (the `# ->` lines, an abridged JSON answer) are the ones that
come back, by the rule tests/support/doc_blocks.py states.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.support.doc_blocks import (README, ROOT, abridged_answers, agrees, curl_examples, expected_lines,
                                      parse_abridged, run_curl, sdk_snippets)

DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _name(path) -> str:
    return str(path.relative_to(ROOT))


def every(find) -> list:
    """pytest params of (page, item) for every page: README.md and docs/*.md."""
    return [pytest.param(path, item, id=f"{_name(path)}:{_ident(item)}") for path in DOCS for item in find(path)]


def _ident(item) -> str:
    block = item[0] if isinstance(item, tuple) else item
    return block.strip().split("\n")[0][:60]


# --- the tests ----------------------------------------------------------------------------------------------
def test_the_docs_have_a_curl_example_per_option():
    text = "\n".join(example for path in DOCS for example in curl_examples(path))
    for option in ("losses", "input_grad", "hvp", "per_sample", "micro_batch", "freeze", "checkpoint_segments",
                   "graph", "directional", "timing_repeat", "/estimate", "wait=0", "exact", "shards"):
        assert option in text, option


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_every_curl_example_prints_figures_the_test_can_read(path):
    answered = {example for example, _ in abridged_answers(path)}
    for example in curl_examples(path):
        assert "# ->" in example or example in answered, example.splitlines()[0]
        if "# ->" in example:
            assert parse_abridged(expected_lines(example)), example.splitlines()[0]


def test_the_comparison_catches_a_wrong_figure():
    expected = parse_abridged('"loss": 1.586, "losses": {"task": 1.353, ...}, "n": 3, "t": {"total_ms": 9.0}')
    assert not agrees(expected, {"loss": 1.58612, "losses": {"task": 1.3534, "x": 1}, "n": 3, "t": {"total_ms": 1e3}})
    assert agrees(expected, {"loss": 1.5871, "losses": {"task": 1.353}, "n": 3, "t": {"total_ms": 1}})
    assert agrees(expected, {"loss": 1.586, "losses": {"task": 1.353}, "n": 3.0, "t": {"total_ms": 1}})
    assert agrees(parse_abridged('{"data": [1.7147, 1.0633]}'), {"data": [1.7147]})


@pytest.mark.parametrize("path, example", every(curl_examples))
def test_curl_example_answers_the_figures_it_shows(path, example, stack):
    out = run_curl(example, stack.base_url, stack.auth_headers())
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert "error" not in body, body
    assert body.get("status") in ("finished", "queued", "started", None), body  # a 202 says what the job is doing
    if "# ->" in example:  # else its answer is the ```json block below it (the next test)
        problems = agrees(parse_abridged(expected_lines(example)), body)
        assert not problems, problems


def test_the_first_request_shows_its_answer():
    assert abridged_answers(README), "the README's first request shows its answer as a ```json block"


@pytest.mark.parametrize("path, pair", every(abridged_answers))
def test_an_abridged_answer_is_what_comes_back(path, pair, stack):
    example, answer = pair
    out = run_curl(example, stack.base_url, stack.auth_headers())
    body = json.loads(out.stdout)
    problems = agrees(parse_abridged(answer), body)
    assert not problems, problems


def test_the_readme_has_an_sdk_snippet():
    assert sdk_snippets(README)


@pytest.mark.parametrize("path, snippet", every(sdk_snippets))
def test_sdk_snippet_prints_the_figures_it_shows(path, snippet, stack):
    code = snippet.replace("http://127.0.0.1:8000", stack.base_url)
    env = {**os.environ, "GRADSVC_API_KEY": stack.api_key} if stack.api_key else dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    shown = expected_lines(snippet)
    problems = agrees(parse_abridged(shown), json.loads(out.stdout.strip().splitlines()[-1]))
    assert not problems, (problems, out.stdout)


_NUMBER = re.compile(r"(\d[\d,]*(?:\.\d+)?(?:e[-+]\d+)?)")


def printed_lines_agree(shown: str, printed: str) -> list[str]:
    """Line by line, the words equal and the numbers as the module docstring says: timings any, an error
    printed as 1.23e-07 within a factor of 10, every other number as printed."""
    problems = []
    shown_lines, printed_lines = shown.strip().splitlines(), printed.strip().splitlines()
    if len(shown_lines) != len(printed_lines):
        return [f"{len(printed_lines)} lines printed, the page shows {len(shown_lines)}"]
    for want, got in zip(shown_lines, printed_lines):
        w, g = _NUMBER.split(want), _NUMBER.split(got)
        if len(w) != len(g) or w[::2] != g[::2]:
            problems.append(f"printed {got!r}, the page shows {want!r}")
            continue
        for a, b in zip(w[1::2], g[1::2]):
            if want.startswith("Timings"):
                continue
            if re.fullmatch(r"\d\.\d+e-\d+", a) and float(b) > 0 and abs(math.log10(float(b) / float(a))) <= 1:
                continue
            if a != b:
                problems.append(f"{b} printed where the page shows {a}, in {want!r}")
    return problems


def test_examples_summary_prints_the_table_the_docs_show(stack):
    """The copy in docs/sdk.md is what the example prints, the numerical check's line whole (its
    returned-gradient part included)."""
    text = (ROOT / "docs" / "sdk.md").read_text()
    shown = re.search(r"From\n`examples/summary.py`, a small CNN at batch 32:\n\n```\n(.*?)```", text, re.S)[1]
    env = {**os.environ, "GRADSVC_API_KEY": stack.api_key} if stack.api_key else dict(os.environ)
    out = subprocess.run([sys.executable, "examples/summary.py", "--base-url", stack.base_url, "--out", ""],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    problems = printed_lines_agree(shown, out.stdout)
    assert not problems, (problems, out.stdout)
    assert printed_lines_agree("max rel error 1.47e-07 (tolerance 1e-06)", "max rel error 1.2e-05 (tolerance 1e-06)")


def test_the_route_table_says_get_jobs_is_404_for_an_unknown_job(http):
    """The route table says GET /jobs/{id} is a 404 for an unknown job, not "always 200"."""
    row = next(line for line in (ROOT / "docs" / "api.md").read_text().splitlines()
               if line.startswith("| `GET /jobs/{id}`"))
    assert "always 200" not in row and "404" in row and "not_found" in row
    r = http.get("/jobs/no-such-job")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
