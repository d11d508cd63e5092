"""POST /estimate's answer."""

from __future__ import annotations

from msgspec import Struct

from gradsvc.wire.result import Memory


class Estimate(Struct):
    parameter_count: int
    memory: Memory
    # The bytes options.curvature's Lanczos basis holds at most (0 without curvature); GRADSVC_MAX_KRYLOV_BYTES
    # bounds it.
    krylov_bytes: int = 0
