"""Training runs: a request's `run`, and each recorded step read back (GET /runs, /runs/{name})."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

# A run's name: shown on pages and in CSV (escaped there), a Prometheus label value and a path segment of
# /runs/{name}, hence no "/" and no control characters.
RUN_NAME_PATTERN = r"^[^/\x00-\x1f\x7f]+$"
RunName = Annotated[str, Meta(min_length=1, max_length=128, pattern=RUN_NAME_PATTERN)]
MAX_RUN_STEP = 10**12


class RunRef(Struct, forbid_unknown_fields=True):
    """`run` on POST /gradients: the training run this request is a step of (docs/runs.md). `step` null: the
    service numbers it, one after the run's last recorded step (0 for its first)."""

    name: RunName
    # At most 10^12: the record script (Lua, whose numbers are doubles) writes every step number exactly.
    step: Annotated[int, Meta(ge=0, le=MAX_RUN_STEP)] | None = None


class RunCheck(Struct):
    """A step's numerical check in brief: the mode that ran, its verdict and its largest relative error;
    `passed` null when the check did not run (mode "off")."""

    mode: str
    passed: bool | None
    max_rel_error: float


class RunStep(Struct):
    """One recorded step of a run (GET /runs/{name}). Norms are L2 norms of the returned batch gradient
    (before any clipping); a module is a parameter's parent path ("0" for layer 0 of a layer spec,
    "blocks.0.attn" in a graph model; a parameter of the root module is a module of its own). `update_ratio`
    is |w_t - w_(t-1)| / |w_(t-1)| per module against the run's previous step, null on its first step or
    where the previous step's weights were not kept (GRADSVC_RUN_WEIGHTS_MAX_BYTES)."""

    step: int
    job_id: str
    ended_at: str
    loss: float
    grad_norm: float
    module_grad_norms: dict[str, float]
    total_ms: float
    losses: dict[str, float] | None = None
    update_ratio: dict[str, float] | None = None
    noise_scale: float | None = None
    clip: dict[str, Any] | None = None
    numcheck: RunCheck | None = None


class RunSummary(Struct):
    """One entry of GET /runs: a run's name, how many steps it keeps, its last step and when it was updated."""

    name: str
    steps: int
    last_step: int | None
    updated_at: str


class RunInfo(Struct):
    name: str
    steps: list[RunStep]
