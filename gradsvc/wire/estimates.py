"""POST /estimate's answer."""

from __future__ import annotations

from msgspec import Struct

from gradsvc.wire.result import Memory


class Estimate(Struct):
    parameter_count: int
    memory: Memory
