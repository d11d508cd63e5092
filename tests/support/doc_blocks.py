"""The documentation's runnable blocks as data, and the rule that compares what they print with what the page
shows: read by tests/integration/test_readme.py (every block of every page against a test stack) and by
tests/support/first_run.py (the first blocks against `make run`, in CI before any test tool is installed), so it
imports nothing outside the standard library.

Tolerances, as the README states them: a number agrees to the precision it is printed with (half a unit
in its last digit; integers exactly); the numerical check's errors (`max_abs_error`, `max_rel_error`)
within a factor of 10, since they are rounding noise that depends on the BLAS; timings (`*_ms`) are only
required to be present and non-negative, but a timing shown as 0 (a phase that did not run) must be 0.
Strings are equal, but for a trailing `…` (a prefix). `...` stands for elements or fields left out.
"""

from __future__ import annotations

import math
import re
import subprocess
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ANY = object()  # `...` in value position


def fenced_blocks(path: Path = README) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", path.read_text(), flags=re.S)


def curl_examples(path: Path = README) -> list[str]:
    return [body for lang, body in fenced_blocks(path) if lang == "sh" and body.lstrip().startswith("curl ")]


def abridged_answers(path: Path = README) -> list[tuple[str, str]]:
    """(curl block, json block) where a ```json block is the next fenced block after a curl example."""
    blocks = fenced_blocks(path)
    return [(blocks[i][1], blocks[i + 1][1]) for i in range(len(blocks) - 1)
            if blocks[i][0] == "sh" and blocks[i][1].lstrip().startswith("curl ") and blocks[i + 1][0] == "json"]


def sdk_snippets(path: Path = README) -> list[str]:
    return [body for lang, body in fenced_blocks(path) if lang == "python" and "Client(" in body and "# ->" in body]


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


def run_curl(example: str, base_url: str = "http://127.0.0.1:8000",
             headers: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The block as a shell runs it, its `#` lines left out, against `base_url` with `headers` on its first curl."""
    command = "\n".join(line for line in example.splitlines() if not line.startswith("#"))
    command = command.replace("http://127.0.0.1:8000", base_url)
    for name, value in (headers or {}).items():
        command = command.replace("curl -s", f"curl -s -H '{name}: {value}'", 1)
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
