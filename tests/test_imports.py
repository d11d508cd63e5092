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


# Module-level state: what a module keeps and changes after import (a container it mutates, a name a function
# rebinds with `global`, a lock, a counter, a registry, a memo). Everything else a process keeps lives in an
# object its entry point builds (Engine(config) and its caches, create_app's ApiState, the WorkerContext, the
# SDK's Client), so two of them never share it. Each entry here says why it cannot.
MODULE_STATE = {
    "gradsvc.engine.tensors._read_only_warned":
        "mirrors torch's own warn-once flag for a read-only buffer, which is per process: once torch has warned, "
        "catching the warning costs ~5 us a tensor for nothing",
    "gradsvc.engine.prepare_layers._seed_lock":
        "seeding sets torch's default generator, which is per process whichever Engine asks",
    "service.http_server.CLOSED":
        "connections uvicorn's protocol refused or cut, read by /metrics: uvicorn builds the protocol class, not "
        "create_app, so the module is where the two meet (one API process, one count)",
    "service.messages._homes":
        "a memo of a pure function of a wire type (where a field name lives in the schema), bounded to 8 types",
    "gradclient.functions._LIB":
        "torch's operator registry is per process and a Library cannot drop an op it defined",
    "gradclient.functions._numbers":
        "the custom Functions' op names, never reused within the process (the Library cannot drop an op)",
    "gradclient.tensors.decode_type":
        "a memo of a pure function of a wire type (its decode-side twin), one entry per Struct type",
}
_CONTAINERS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "deque", "Counter", "WeakSet",
               "WeakKeyDictionary", "WeakValueDictionary"}
_STATEFUL = {"Lock", "RLock", "Condition", "Event", "Semaphore", "local", "count", "Library", "Random", "Queue",
             "LRU"}
_MEMOS = {"cache", "lru_cache"}
_MUTATORS = {"append", "add", "update", "pop", "clear", "setdefault", "extend", "insert", "remove", "discard",
             "popitem", "appendleft", "popleft", "sort", "reverse"}


def _called(node: ast.AST) -> str | None:
    func = node.func if isinstance(node, ast.Call) else node
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _module_level(tree: ast.Module) -> tuple[dict[str, str], dict[str, str]]:
    """(containers, always state): the module-level names bound to a mutable container, and those that are
    state whatever is done with them (a lock, a counter, a registry, a memoised function)."""
    containers, state = {}, {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(_called(d) in _MEMOS for d in node.decorator_list):
                state[node.name] = "memo"
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if \
            isinstance(node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        for target in (t for t in targets if isinstance(t, ast.Name)):
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or \
                    (isinstance(value, ast.Call) and _called(value) in _CONTAINERS):
                containers[target.id] = "container"
            elif isinstance(value, ast.Call) and _called(value) in _STATEFUL:
                state[target.id] = _called(value)
    return containers, state


def _aliases(name: str, tree: ast.Module) -> dict[str, str]:
    """Local name -> the project object it names ("module" or "module.attribute"), from this file's imports."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            out.update({a.asname: a.name for a in node.names if a.asname})
    return out


def _mutated(name: str, tree: ast.Module) -> set[str]:
    """Every "module.attribute" this file changes: item assignment or deletion, a mutating method, and each
    name its functions rebind with `global` (marked "global:module.name")."""
    aliases = _aliases(name, tree)

    def owner(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id, f"{name}.{node.id}")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            return f"{aliases[node.value.id]}.{node.attr}"
        return None

    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.update(f"global:{name}.{n}" for n in node.names)
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        out.update(owner(t.value) for t in targets if isinstance(t, ast.Subscript))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            out.add(owner(node.func.value))
    return out - {None}


def module_state() -> set[str]:
    """Every module-level name of the project that is state (see MODULE_STATE), as "module.name"."""
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    mutated = set().union(*(_mutated(name, tree) for name, tree in trees.items()))
    found = set()
    for name, tree in trees.items():
        containers, state = _module_level(tree)
        found.update(f"{name}.{n}" for n in state)
        found.update(f"{name}.{n}" for n in containers if f"{name}.{n}" in mutated)
    return found | {m.removeprefix("global:") for m in mutated if m.startswith("global:")}


def test_no_module_level_state_outside_the_table():
    found = module_state()
    assert sorted(found - set(MODULE_STATE)) == [], "module-level state: keep it in an object, or list it with why"
    assert sorted(set(MODULE_STATE) - found) == [], "MODULE_STATE lists state that is gone: drop the entry"


def test_the_state_finder_finds_each_kind():
    source = ("import threading, functools\nA = {}\nB = []\nC = set()\nD = {'k': 1}\nE = threading.Lock()\n"
              "F = 0\n@functools.cache\ndef g(x):\n    return x\n"
              "def h():\n    global F\n    F = 1\n    A['x'] = 1\n    B.append(1)\n    return D['k']\n")
    tree = ast.parse(source)
    containers, state = _module_level(tree)
    assert set(containers) == {"A", "B", "C", "D"} and set(state) == {"E", "g"}
    assert _mutated("gradsvc", tree) == {"global:gradsvc.F", "gradsvc.A", "gradsvc.B"}


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
