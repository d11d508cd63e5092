"""The size rules (docs/architecture.md, "Size rules"): in the project's modules (gradsvc, service, workers,
gradclient) no function is over 60 lines or takes over 7 parameters (self and cls not counted, *args and
**kwargs one each), no class is over 250 lines and no file over 600 (a wire module over 300: one resource each). Read from the source (ast), as tests/test_imports.py
reads the imports.

One list names what may break them, PUBLIC_CALLS, the one exception: the SDK's public calls whose keyword
arguments mirror the request's fields (docs/sdk.md), and the client's constructor, whose keywords are its
settings. They may take more than 7 parameters, nothing else: the calls do nothing but build the call object
(request.Call).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gradsvc", "service", "workers", "gradclient")
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 7
MAX_CLASS_LINES = 250
MAX_FILE_LINES = 600
MAX_WIRE_MODULE_LINES = 300

PUBLIC_CALLS = frozenset({
    "gradclient/base.py::BaseClient.__init__",  # Client(...) and AsyncClient(...): the client's settings
    "gradclient/client.py::Client.gradients",
    "gradclient/client.py::Client.submit",
    "gradclient/client.py::Client.estimate",
    "gradclient/client.py::AsyncClient.gradients",
    "gradclient/client.py::AsyncClient.submit",
    "gradclient/client.py::AsyncClient.estimate",
})


class Size(NamedTuple):
    lines: int
    parameters: int  # 0 for a class
    is_class: bool = False


def measure(source: str) -> dict[str, Size]:
    """Every function's and class's size in `source`, by qualified name ("Class.method", "outer.inner")."""
    sizes: dict[str, Size] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                lines = child.end_lineno - child.lineno + 1
                is_class = isinstance(child, ast.ClassDef)
                size = Size(lines, 0 if is_class else _parameters(child.args), is_class)
                sizes[name] = max(sizes.get(name, size), size)  # a name defined twice: its larger
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sizes


def _parameters(args: ast.arguments) -> int:
    named = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def broken(size: Size) -> list[str]:
    """The rules `size` breaks: "lines", "parameters"."""
    out = []
    if size.lines > (MAX_CLASS_LINES if size.is_class else MAX_FUNCTION_LINES):
        out.append("lines")
    if size.parameters > MAX_PARAMETERS:
        out.append("parameters")
    return out


def _project() -> dict[str, Size]:
    """Every function and class of the project's modules by "path::qualname"."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name, size in measure(path.read_text()).items():
                found[f"{path.relative_to(ROOT).as_posix()}::{name}"] = size
    return found


PROJECT = _project()


def _offenders() -> dict[str, tuple[Size, list[str]]]:
    return {key: (size, broken(size)) for key, size in PROJECT.items() if broken(size)}


def test_no_function_or_class_breaks_the_size_rules_outside_its_lists():
    """A function over 60 lines or 7 parameters, or a class over 250 lines, fails here; so does a public
    call past 60 lines."""
    new = []
    for key, ((lines, params, _), rules) in _offenders().items():
        if key in PUBLIC_CALLS and rules == ["parameters"]:
            continue
        new.append(f"  {key}: lines={lines}, parameters={params} (breaks: {', '.join(rules)})")
    assert not new, (
        f"over the size rules (functions <= {MAX_FUNCTION_LINES} lines and <= {MAX_PARAMETERS} parameters, classes "
        f"<= {MAX_CLASS_LINES} lines; docs/architecture.md, 'Size rules'):\n" + "\n".join(new)
        + "\nsplit the function into named steps, or pass one object (a frozen dataclass) instead of many "
        "arguments")


def test_no_file_is_over_600_lines_nor_a_wire_module_over_300():
    over = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            limit = MAX_WIRE_MODULE_LINES if rel.startswith("gradsvc/wire/") else MAX_FILE_LINES
            lines = len(path.read_text().splitlines())
            if lines > limit:
                over.append(f"  {rel}: {lines} lines (at most {limit})")
    assert not over, "files over the size rules; split them by what they own:\n" + "\n".join(over)


def test_the_public_calls_listed_are_there():
    """A PUBLIC_CALLS entry names a call that is there (renamed or moved, it would excuse nothing)."""
    missing = sorted(PUBLIC_CALLS - set(PROJECT))
    assert not missing, f"PUBLIC_CALLS names calls that are not there (renamed or moved?): {missing}"


@pytest.mark.parametrize("key", sorted(k for k in PUBLIC_CALLS if not k.endswith(".__init__")))
def test_a_public_call_of_many_keywords_only_builds_the_call_object(key):
    """The exception's terms: the call's body is its docstring and one return of a flow driven with a
    request.Call built from its keywords."""
    path, qualname = key.split("::")
    cls, name = qualname.split(".")
    tree = ast.parse((ROOT / path).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    assert len(body) == 1 and isinstance(body[0], ast.Return), f"{key}: more than `return self._drive(...)`"
    calls = [n.func.id for n in ast.walk(body[0]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert calls == ["Call"], f"{key} builds {calls}, not one request.Call"


def test_the_measure_counts_lines_and_parameters_as_the_rules_say():
    body = "\n".join(f"    x{i} = {i}" for i in range(58))
    source = (
        "class A:\n"
        "    def m(self, a, b, c, d, e, f, g):\n        pass\n"
        "    @classmethod\n    def k(cls, a, b, c, d, e, f, g, h):\n        pass\n"
        "def star(a, b, c, d, e, f, *args, **kwargs):\n    pass\n"
        f"def sixty():\n    '''doc'''\n{body}\n"
        f"def sixty_one():\n    '''doc'''\n{body}\n    return x0\n"
        "def outer():\n    async def inner(a, b, c, d, e, f, g, h):\n        pass\n"
    )
    sizes = measure(source)
    assert sizes["A.m"] == (2, 7, False) and sizes["A.k"] == (2, 8, False) and sizes["star"] == (2, 8, False)
    assert sizes["sixty"].lines == 60 and sizes["sixty_one"].lines == 61 and sizes["outer.inner"] == (2, 8, False)
    assert sizes["A"] == (6, 0, True)
    assert broken(sizes["A.m"]) == [] and broken(sizes["A.k"]) == ["parameters"]
    assert broken(sizes["star"]) == ["parameters"]
    assert broken(sizes["sixty"]) == [] and broken(sizes["sixty_one"]) == ["lines"]
    assert broken(Size(250, 0, True)) == [] and broken(Size(251, 0, True)) == ["lines"]
    assert broken(Size(61, 8)) == ["lines", "parameters"]
