"""GET /layers' entries: each layer type and its constructor arguments."""

from __future__ import annotations

from typing import Any

from msgspec import Struct


class LayerArgument(Struct):
    """One constructor argument of a layer type, as gradsvc.layers checks it: `kind` (the JSON forms
    accepted), torch's `default` (absent when `required`), the `range` or choices enforced ("" for any)."""

    kind: str
    required: bool
    default: Any = None
    range: str = ""


class LayerInfo(Struct):
    """One entry of GET /layers. `arguments` maps each argument to its kind and range in brief
    ("int >= 1"); `details` gives them apart, with torch's default. `output` is "sequence" for the recurrent layers (their output
    sequence, without the final state)."""

    type: str
    arguments: dict[str, str]
    required: list[str]
    container: bool = False
    details: dict[str, LayerArgument] = {}
    output: str = "tensor"
