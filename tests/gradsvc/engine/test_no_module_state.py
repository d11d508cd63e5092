"""The engine keeps no state at module level: every cache is an LRU of an Engine's EngineCaches, which the
API, each worker, a test or a bench creates. Read from the source (ast) for the names each module assigns at
its top level, then from the imported module for what they hold: no dict, list, set, deque, bytearray or
LRU (constant tables are MappingProxyType, frozenset or tuple)."""

from __future__ import annotations

import ast
import collections
import importlib
import pkgutil
from pathlib import Path

from gradsvc.engine import Engine, EngineConfig
import gradsvc.engine
from gradsvc.lru import LRU

MUTABLE = (dict, list, set, collections.deque, bytearray, LRU)


def _assigned(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if \
            isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    names.add(name.id)
    return names - {"__all__"}


def test_no_engine_module_holds_a_mutable_container_or_cache():
    found = []
    for info in pkgutil.walk_packages(gradsvc.engine.__path__, "gradsvc.engine."):  # sub-packages' modules too
        module = importlib.import_module(info.name)
        for name in _assigned(Path(module.__file__)):
            if isinstance(getattr(module, name, None), MUTABLE):
                found.append(f"{info.name.removeprefix('gradsvc.engine.')}.{name}: {type(getattr(module, name)).__name__}")
    assert found == []
    assert len(list(pkgutil.walk_packages(gradsvc.engine.__path__, "gradsvc.engine."))) > 20  # the walk saw the modules


def test_two_engines_share_no_cache():
    a, b = Engine(), Engine(EngineConfig(init_cache_bytes=1 << 20))
    for field in vars(a.caches):
        assert isinstance(getattr(a.caches, field), LRU) and getattr(a.caches, field) is not getattr(b.caches, field)
    assert b.caches.initial_states.max_bytes == 1 << 20
