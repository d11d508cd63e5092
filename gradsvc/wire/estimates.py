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
    # POST /estimate: the limits the request was checked under, and which workers' device they came from.
    limits: EstimateLimits | None = None


class EstimateLimits(Struct):
    """The limits a request was checked under: `device` "cuda" (those of the smallest live CUDA device the job
    may go to: its element and memory limits follow its memory unless set), "cpu" (the settings': a CPU worker
    may take the job) or "settings" (no live worker said what it has)."""

    device: str
    max_elements: int
    max_job_bytes: int
    max_parameters: int
    device_name: str | None = None
    device_bytes: int | None = None
