"""Schema errors as messages a user can act on: msgspec's terse validation texts ("Invalid enum value
'full' - at `$.options.numcheck`") rewritten to say where, what is valid there and how to fix it.

The valid fields and values come from the wire Structs themselves (msgspec.inspect), so the messages
cannot drift from the schema.
"""

from __future__ import annotations

import difflib
import re
from functools import lru_cache
from typing import Any

import msgspec
from msgspec import inspect as mi

_AT = re.compile(r"^(?P<what>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.S)
_TOKEN = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+|\.\.\.)\]")
DOCS = "docs/api.md and GET /schema"


def human_path(path: str) -> str:
    """`$.options.numcheck` -> `options.numcheck`; `$` -> `the body`."""
    return "the body" if path in ("", "$") else path.removeprefix("$.").removeprefix("$").replace("[...]", "[name]")


def _tokens(path: str) -> list[str | int]:
    out: list[str | int] = []
    for name, index in _TOKEN.findall(path):
        out.append(name if name else (int(index) if index.isdigit() else "[...]"))
    return out


def _members(t: mi.Type) -> list[mi.Type]:
    if isinstance(t, mi.UnionType):
        return [m for u in t.types for m in _members(u)]
    if isinstance(t, mi.Metadata):
        return _members(t.type)
    return [t]


def _step(t: mi.Type, token: str | int) -> mi.Type | None:
    for m in _members(t):
        if isinstance(token, str) and token != "[...]" and isinstance(m, mi.StructType):
            for f in m.fields:
                if f.encode_name == token:
                    return f.type
        if isinstance(token, int) and isinstance(m, (mi.ListType, mi.VarTupleType)):
            return m.item_type
        if token == "[...]" and isinstance(m, mi.DictType):
            return m.value_type
        if isinstance(token, str) and isinstance(m, mi.DictType):
            return m.value_type
    return None


def type_at(root: type, path: str) -> mi.Type | None:
    t: mi.Type | None = mi.type_info(root)
    for token in _tokens(path):
        t = _step(t, token) if t is not None else None
    return t


def _struct_fields(t: mi.Type | None) -> list[str]:
    names: list[str] = []
    for m in _members(t) if t is not None else []:
        if isinstance(m, mi.StructType):
            names += [f.encode_name for f in m.fields if f.encode_name not in names]
    return names


def _literal_values(t: mi.Type | None) -> list[Any]:
    return [v for m in (_members(t) if t is not None else []) if isinstance(m, mi.LiteralType) for v in m.values]


@lru_cache(maxsize=8)
def _homes(root: type) -> dict[str, list[str]]:
    """field name -> every path where the schema takes it (`weights` -> [`model.weights`])."""
    homes: dict[str, list[str]] = {}

    def walk(t: mi.Type, path: str, seen: frozenset) -> None:
        for m in _members(t):
            if isinstance(m, mi.StructType) and m.cls not in seen:
                for f in m.fields:
                    where = f"{path}.{f.encode_name}" if path else f.encode_name
                    homes.setdefault(f.encode_name, []).append(where)
                    walk(f.type, where, seen | {m.cls})
            elif isinstance(m, (mi.ListType, mi.VarTupleType)):
                walk(m.item_type, f"{path}[i]", seen)
            elif isinstance(m, mi.DictType):
                walk(m.value_type, f"{path}[name]", seen)

    walk(mi.type_info(root), "", frozenset())
    return homes


def _quote(values: list[Any]) -> str:
    return ", ".join(repr(v) if isinstance(v, str) else str(v) for v in values)


def explain(exc: msgspec.ValidationError, root: type) -> tuple[str, dict[str, Any]]:
    """(message, detail) for a body that does not match `root`'s schema."""
    m = _AT.match(str(exc))
    what, path = (m["what"], m["path"] or "$") if m else (str(exc), "$")
    where = human_path(path)
    detail: dict[str, Any] = {"path": path}
    here = type_at(root, path)

    if unknown := re.fullmatch(r"Object contains unknown field `(.+)`", what):
        name = unknown[1]
        valid = _struct_fields(here)
        detail.update(field=name, valid=valid)
        message = f"{where}: unknown field `{name}`"
        prefix = "" if path in ("", "$") else f"{where}."
        elsewhere = [h for h in _homes(root).get(name, []) if h != f"{prefix}{name}" and "[" not in h]
        close = difflib.get_close_matches(name, valid, n=1)
        if elsewhere:
            detail["belongs_in"] = elsewhere[0]
            message += f"; it belongs in `{elsewhere[0]}`"
            if name == "weights":
                message += ' ({"model": {"layers": [...], "weights": {"0.weight": tensor, ...}}})'
        elif close:
            message += f" (did you mean `{close[0]}`?)"
        if valid:
            message += f"; {where} takes: {', '.join(valid)}"
        return message, detail

    if missing := re.fullmatch(r"Object missing required field `(.+)`", what):
        name = missing[1]
        detail.update(field=name)
        return f"{where}: required field `{name}` is missing; add it (see {DOCS})", detail

    if enum := re.fullmatch(r"Invalid enum value (.+)", what):
        valid = _literal_values(here)
        detail.update(value=enum[1].strip("'\""), valid=valid)
        if valid:
            return f"{where}: {enum[1]} is not a valid value; use one of {_quote(valid)}", detail
        return f"{where}: {enum[1]} is not a valid value (see {DOCS})", detail

    if expected := re.fullmatch(r"Expected (.+?)(?:, got `(.+)`)?", what):
        want = expected[1].replace("`", "")
        for op, words in ((">=", "at least"), ("<=", "at most"), (">", "above"), ("<", "below")):
            want = want.replace(f" {op} ", f" {words} ")
        detail.update(expected=want)
        message = f"{where}: expected {want}"
        if expected[2]:
            detail["got"] = expected[2]
            message += f", got {expected[2]}"
        valid = _literal_values(here)
        if valid:
            message += f"; use one of {_quote(valid)}"
        elif "length at least" in want:
            message += "; it must not be empty"
        return message + f" (see {DOCS})", detail

    return f"{where}: {what} (see {DOCS})", detail


_INT_GOT_FLOAT = re.compile(r"^Expected `int(?: \| (?:null|str))*`(?: [^,]*)?, got `float` - at `(?P<path>[^`]*)`$")


def integral_floats_as_ints(raw: Any, exc: msgspec.ValidationError, *, tries: int = 16) -> Any | None:
    """JSON Schema counts 2.0 as an integer; msgspec does not. Given the body decoded untyped and the error
    for an integer field that got a float, returns the body with each such float that has no fraction made an
    int (at the paths msgspec names, nowhere else), or None when the float had a fraction."""
    m = _INT_GOT_FLOAT.match(str(exc))
    if not m:
        return None
    node: Any = raw
    tokens = _tokens(m["path"])
    if not tokens or "[...]" in tokens:
        return None
    for token in tokens[:-1]:
        try:
            node = node[token]
        except (KeyError, IndexError, TypeError):
            return None
    last = tokens[-1]
    try:
        value = node[last]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(value, float) or not value.is_integer():
        return None
    node[last] = int(value)
    return raw
