"""Every curl example and SDK snippet in the README and in every docs/*.md page runs as written against a
live stack, and the figures each page prints (the `# ->` lines, an abridged JSON answer) are the ones that
come back.

Tolerances, as the README states them: a number agrees to the precision it is printed with (half a unit
in its last digit; integers exactly); the numerical check's errors (`max_abs_error`, `max_rel_error`)
within a factor of 10, since they are rounding noise that depends on the BLAS; timings (`*_ms`) are only
required to be present and non-negative, but a timing shown as 0 (a phase that did not run) must be 0.
Strings are equal, but for a trailing `…` (a prefix). `...` stands for elements or fields left out.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
ANY = object()  # `...` in value position


def fenced_blocks(path: Path = README) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", path.read_text(), flags=re.S)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def curl_examples(path: Path = README) -> list[str]:
    return [body for lang, body in fenced_blocks(path) if lang == "sh" and body.lstrip().startswith("curl ")]


def abridged_answers(path: Path = README) -> list[tuple[str, str]]:
    """(curl block, json block) where a ```json block is the next fenced block after a curl example."""
    blocks = fenced_blocks(path)
    return [(blocks[i][1], blocks[i + 1][1]) for i in range(len(blocks) - 1)
            if blocks[i][0] == "sh" and blocks[i][1].lstrip().startswith("curl ") and blocks[i + 1][0] == "json"]


def sdk_snippets(path: Path = README) -> list[str]:
    return [body for lang, body in fenced_blocks(path) if lang == "python" and "Client(" in body and "# ->" in body]


def every(find) -> list:
    """pytest params of (page, item) for every page: README.md and docs/*.md."""
    return [pytest.param(path, item, id=f"{_name(path)}:{_ident(item)}") for path in DOCS for item in find(path)]


def _ident(item) -> str:
    block = item[0] if isinstance(item, tuple) else item
    return block.strip().split("\n")[0][:60]


def expected_lines(block: str) -> str:
    """The `# ->` comment with its `#` continuation lines, up to the first `;` outside brackets (prose)."""
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# ->"))
    text = lines[start][4:]
    for line in lines[start + 1:]:
        if not line.startswith("#    "):
            break
        text += " " + line[1:]
    depth, in_string = 0, False
    for i, ch in enumerate(text):
        if ch == '"':
            in_string = not in_string
        elif not in_string and ch in "[{":
            depth += 1
        elif not in_string and ch in "]}":
            depth -= 1
        elif not in_string and depth == 0 and ch == ";":
            return text[:i].strip()
    return text.strip()


# --- a JSON reader that takes `...` / `…` for what is left out -------------------------------------------
class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.i = text.replace("…", "…"), 0

    def ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \n\t":
            self.i += 1

    def peek(self, s: str) -> bool:
        self.ws()
        return self.text.startswith(s, self.i)

    def take(self, s: str) -> None:
        assert self.peek(s), f"expected {s!r} at {self.text[self.i:self.i + 40]!r}"
        self.i += len(s)

    def ellipsis(self) -> bool:
        for mark in ("...", "…"):
            if self.peek(mark):
                self.i += len(mark)
                return True
        return False

    def value(self) -> Any:
        if self.ellipsis():
            return ANY
        if self.peek("{"):
            return self.obj()
        if self.peek("["):
            return self.arr()
        if self.peek('"'):
            end = self.text.index('"', self.i + 1)
            s = self.text[self.i + 1:end]
            self.i = end + 1
            return s
        m = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null").match(self.text, self.i)
        assert m, f"cannot read {self.text[self.i:self.i + 40]!r}"
        self.i = m.end()
        return {"true": True, "false": False, "null": None}.get(m[0], Decimal(m[0]) if m[0][0] in "-0123456789"
                                                                 else m[0])

    def members(self, close: str | None) -> dict:
        out: dict = {}
        while not (close and self.peek(close)) and self.i < len(self.text.rstrip()):
            if not self.ellipsis():
                key = self.value()
                self.take(":")
                out[key] = self.value()
            if self.peek(","):
                self.take(",")
            else:
                break
        return out

    def obj(self) -> dict:
        self.take("{")
        out = self.members("}")
        self.take("}")
        return out

    def arr(self) -> list:
        self.take("[")
        out: list = []
        while not self.peek("]"):
            out.append(self.value())
            if self.peek(","):
                self.take(",")
        self.take("]")
        return out


def parse_abridged(text: str) -> dict:
    reader = _Reader(text)
    if reader.peek("{"):
        return reader.obj()
    return reader.members(None)


# --- comparison ---------------------------------------------------------------------------------------------
def agrees(expected: Any, actual: Any, path: str = "$") -> list[str]:
    key = path.rsplit(".", 1)[-1]
    if expected is ANY:
        return []
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{path}: expected an object, got {actual!r}"[:200]]
        problems = []
        for k, v in expected.items():
            if k not in actual:
                problems.append(f"{path}.{k}: missing")
            else:
                problems += agrees(v, actual[k], f"{path}.{k}")
        return problems
    if isinstance(expected, list):
        if not isinstance(actual, list):
            return [f"{path}: expected a list, got {actual!r}"[:200]]
        open_ended = any(e is ANY for e in expected)
        shown = [e for e in expected if e is not ANY]
        if not open_ended and len(shown) != len(actual):
            return [f"{path}: {len(actual)} elements, the page shows {len(shown)}"]
        problems = []
        for i, (e, a) in enumerate(zip(expected, actual)):
            problems += agrees(e, a, f"{path}[{i}]")
        return problems
    if isinstance(expected, Decimal):
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            return [f"{path}: expected a number, got {actual!r}"]
        if key.endswith("_ms"):  # timings: the machine's; a phase the page shows as 0 did not run
            if expected == 0:
                return [] if actual == 0 else [f"{path}: {actual}, the page shows 0 (a phase that did not run)"]
            return [] if actual >= 0 else [f"{path}: negative time {actual}"]
        if key in ("max_abs_error", "max_rel_error"):
            e = float(expected)
            ok = (e == 0 and actual < 1e-12) or (e > 0 and actual > 0 and abs(math.log10(actual / e)) <= 1)
            return [] if ok else [f"{path}: {actual:g} is not within a factor of 10 of the page's {expected}"]
        if expected.as_tuple().exponent >= 0 and "." not in str(expected) and "e" not in str(expected).lower():
            return [] if actual == int(expected) and isinstance(actual, int) else \
                [f"{path}: {actual!r}, the page shows the integer {expected}"]
        half_unit = 0.5 * 10.0 ** expected.as_tuple().exponent
        return [] if abs(actual - float(expected)) <= half_unit * 1.0001 else \
            [f"{path}: {actual!r}, the page shows {expected} (to within {half_unit:g})"]
    if isinstance(expected, str) and expected.endswith("…"):
        return [] if isinstance(actual, str) and actual.startswith(expected[:-1]) else [f"{path}: {actual!r}"]
    return [] if expected == actual else [f"{path}: {actual!r}, the page shows {expected!r}"]


def run_curl(example: str, stack) -> subprocess.CompletedProcess:
    command = "\n".join(line for line in example.splitlines() if not line.startswith("#"))
    command = command.replace("http://127.0.0.1:8000", stack.base_url)
    for name, value in stack.auth_headers().items():
        command = command.replace("curl -s", f"curl -s -H '{name}: {value}'", 1)
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)


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
    out = run_curl(example, stack)
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
    out = run_curl(example, stack)
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
