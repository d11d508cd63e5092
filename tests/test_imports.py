"""The import graph of the project's own modules: every import points down the layer table, and no two
modules import each other, directly or through others. Read from the source (ast), imports inside
functions included, so a lazy import cannot hide an upward edge.

    gradsvc (the contract: wire.*, layers, modules, lru, hashing)       imports nothing of the project
    gradsvc.runtime.* (settings, malloc, the command and its launcher)  the contract
      and gradsvc.__main__
    gradsvc.broker.* (Redis and RQ)                                     the above
    gradsvc.engine.* (PyTorch only: no Redis, no HTTP, no environment)  the contract
    gradclient.* (the SDK)                                              the contract
    workers.* (the RQ side)                                             everything above
    service.* (the API)                                                 everything above but workers.* (jobs
                                                                        are enqueued by dotted path)

No row imports anything: the `gradsvc` command (gradsvc.runtime.cli) names the API's and the worker's entry
points by dotted path, as the API names the job functions, so nothing in gradsvc imports service/ or workers/.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gradsvc", "service", "workers", "gradclient")
CONTRACT = ("gradsvc", "gradsvc.wire", "gradsvc.layers", "gradsvc.modules", "gradsvc.lru", "gradsvc.hashing")
CONFIG = ("gradsvc.runtime", "gradsvc.__main__")  # and every module below gradsvc.runtime


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports (a `from package import module` counts as the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str:
    if name in CONTRACT or name.startswith("gradsvc.wire."):
        return "contract"
    if name in CONFIG or name.startswith("gradsvc.runtime."):
        return "config"
    for prefix, layer in (("gradsvc.broker", "broker"), ("gradsvc.engine", "engine"), ("gradclient", "sdk"),
                          ("workers", "workers"), ("service", "service")):
        if name == prefix or name.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{name} is in no row of the layer table")


ALLOWED = {
    "contract": {"contract"},
    "config": {"contract", "config"},
    "broker": {"contract", "config", "broker"},
    "engine": {"contract", "engine"},
    "sdk": {"contract", "sdk"},
    "workers": {"contract", "config", "broker", "engine", "workers"},
    "service": {"contract", "config", "broker", "engine", "service"},
}
# Cycles being removed: the test fails on any other, and on one of these once gone.
KNOWN_CYCLES: list[list[str]] = []


def test_the_table_knows_every_module():
    assert {"gradsvc.wire", "gradsvc.broker.keys", "gradsvc.engine.prepare", "service.app",
            "gradclient.client", "gradsvc.runtime.cli"} <= set(MODULES)


def test_every_package_folder_is_shipped():
    """pyproject's explicit package list names every folder with an __init__.py (a wheel leaves out the rest)."""
    shipped = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for d in PACKAGES for p in (ROOT / d).rglob("__init__.py")}
    assert folders - shipped == set()


def test_every_import_points_down_the_layer_table():
    upward = sorted((name, target) for name, targets in GRAPH.items() for target in targets
                    if _layer(target) not in ALLOWED[_layer(name)])
    assert upward == []


def test_no_import_cycle():
    """Tarjan's strongly connected components over the module graph: each must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w.startswith(v + "."):
                continue  # a package's __init__ re-exporting its own modules
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert sorted(cycles) == KNOWN_CYCLES


def test_the_engine_reads_no_environment_and_speaks_neither_redis_nor_http():
    banned = ("redis", "rq", "httpx", "litestar", "uvicorn", "prometheus_client")
    offenders = []
    for name, path in MODULES.items():
        if _layer(name) != "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                offenders += [(name, a.name) for a in node.names if a.name.split(".")[0] in banned]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                if (node.module or "").split(".")[0] in banned:
                    offenders.append((name, node.module))
            elif isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                offenders.append((name, f"os.{node.attr}"))
    assert offenders == []


def test_the_test_tree_mirrors_the_packages():
    """tests/<package>/ holds a package's tests, each folder below one where the package has that folder;
    integration/ and support/ (what the tests and the benches share) stand apart."""
    tests = ROOT / "tests"
    for folder in (p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        rel = folder.relative_to(tests)
        if rel.parts[0] in ("integration", "support"):
            continue
        assert (ROOT / rel).is_dir() and rel.parts[0] in PACKAGES, f"tests/{rel} mirrors no package folder"


BENCH_IMPORTS = """
import importlib.util, sys
from pathlib import Path
bench = Path(sys.argv[1])
sys.path.insert(0, str(bench))
for path in sorted(bench.rglob("*.py")):
    if path.parent.name == "peers" and path.name != "run.py":
        continue  # the peer's own app and worker import celery and fastapi (the bench extra)
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("ok")
"""


def test_every_bench_imports():
    """The benches are run by hand (`make bench`), not by the suite: at least each one's imports resolve
    (bench/peers/run.py still imported a test module the redesign had moved)."""
    out = subprocess.run([sys.executable, "-c", BENCH_IMPORTS, str(ROOT / "bench")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
