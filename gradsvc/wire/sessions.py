"""Training sessions (docs/sessions.md): the weights, buffers and optimizer stay on one worker; each call sends a
batch. POST /sessions, /sessions/{id}/step, /forward_backward, /optim_step, GET /sessions/{id}."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from gradsvc.wire.common import AtLeastOne, NonEmpty
from gradsvc.wire.diagnostics import ClipResult, Diagnostics
from gradsvc.wire.request import ClipOptions, Inputs, LossSpec, ModelSpec, Options
from gradsvc.wire.result import Numcheck
from gradsvc.wire.runs import RunName
from gradsvc.wire.tensors import Tensor

SESSION_RETURNS = ("gradients", "weights", "outputs", "buffers")
SessionId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[0-9a-f]{8,64}$")]
IdempotencyKeyField = Annotated[str, Meta(min_length=1, max_length=255)]


class OptimizerSpec(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """torch.optim.SGD, Adam or AdamW; an argument left out (null) takes torch's default. SGD takes lr,
    momentum, dampening, nesterov, weight_decay, maximize; Adam and AdamW take lr, betas, eps, weight_decay,
    amsgrad, maximize."""

    type: Literal["sgd", "adam", "adamw"]
    lr: Annotated[float, Meta(ge=0)] | None = None
    momentum: Annotated[float, Meta(ge=0)] | None = None
    dampening: float | None = None
    nesterov: bool | None = None
    betas: tuple[Annotated[float, Meta(ge=0, lt=1)], Annotated[float, Meta(ge=0, lt=1)]] | None = None
    eps: Annotated[float, Meta(ge=0)] | None = None
    weight_decay: Annotated[float, Meta(ge=0)] | None = None
    amsgrad: bool | None = None
    maximize: bool | None = None


class SessionOptions(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A session's standing options: global clipping before every optimizer step (`clip`, as options.clip of
    POST /gradients; per_sample is refused), the device, how often its state is checkpointed (null: from its
    size, docs/sessions.md), the parameters left out of the optimizer (`freeze`) and how many workers hold it
    (`workers`)."""

    clip: ClipOptions | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    checkpoint_every: AtLeastOne | None = None
    freeze: list[str] = []
    # Data parallelism: the session held by this many workers at once, each a replica; a batch split along its first
    # dim, the gradients all-reduced with torch.distributed (docs/sessions.md, "A session over several workers").
    workers: Annotated[int, Meta(ge=1, le=64)] = 1


class SessionCreate(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """POST /sessions: the model (its weights inline or by reference), the optimizer, the options and an
    optional run name under which each optimizer step is recorded (GET /runs/{name})."""

    model: ModelSpec
    optimizer: OptimizerSpec
    options: SessionOptions = msgspec.field(default_factory=SessionOptions)
    run: RunName | None = None


class SessionCreated(Struct):
    session_id: str
    step: int
    parameter_count: int
    device: str
    checkpoint_every: int
    state_bytes: int


class SessionBatch(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """POST /sessions/{id}/step and /forward_backward: a batch as POST /gradients takes it. `lr` replaces the
    learning rate from this step on (the schedule is the client's); `return` asks for the gradients (before
    the update, after clipping, in options.gradient_dtype), the weights and buffers after it, forward's
    outputs; `idempotency_key` (or the Idempotency-Key header) makes a retried step answer again, not run."""

    inputs: Inputs
    targets: Any = None
    loss: str | LossSpec | None = None
    losses: Annotated[list[LossSpec], NonEmpty] | None = None
    options: Options = msgspec.field(default_factory=Options)
    lr: Annotated[float, Meta(ge=0)] | None = None
    returns: list[Literal["gradients", "weights", "outputs", "buffers"]] = msgspec.field(default_factory=list,
                                                                                         name="return")
    idempotency_key: IdempotencyKeyField | None = None


class SessionOptimStep(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """POST /sessions/{id}/optim_step: the accumulated gradients clipped and applied, then zeroed."""

    lr: Annotated[float, Meta(ge=0)] | None = None
    returns: list[Literal["gradients", "weights", "buffers"]] = msgspec.field(default_factory=list, name="return")
    idempotency_key: IdempotencyKeyField | None = None


class SessionTimings(Struct):
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    total_ms: float = 0.0
    allreduce_ms: float = 0.0  # a session over several workers: the gradients' all-reduce (and the wait for it)


class MemberTimings(Struct):
    """One worker of a session over several: its part's compute and its all-reduce (which waits for the
    slowest part), in milliseconds."""

    worker: str
    rows: int
    compute_ms: float
    allreduce_ms: float


class SessionStepResult(Struct, omit_defaults=False):
    """What a session operation answers. `step` counts the optimizer steps applied so far (after this call);
    `accumulated` the forward_backward passes whose gradients wait for optim_step; `grad_norm` the L2 norm of the
    gradient the optimizer step used, before clipping (null on forward_backward); `resumed_from` the checkpoint's
    step when this call restored the session on another worker (the steps after it were lost: replay them)."""

    session_id: str
    step: int
    accumulated: int
    loss: float | None = None
    losses: dict[str, float] | None = None
    grad_norm: float | None = None
    lr: float | None = None
    clip: ClipResult | None = None
    gradients: dict[str, Tensor | None] | None = None
    weights: dict[str, Tensor] | None = None
    buffers: dict[str, Tensor] | None = None
    outputs: Any = None
    # POST /sessions/{id}/forward: per loss over class-index targets (cross_entropy, nll), the log-probability
    # of each target, shaped as the targets (the per-element loss negated); null on the other operations.
    logprobs: dict[str, Tensor] | None = None
    device: str = ""
    worker: str = ""
    resumed_from: int | None = None
    replayed: bool = False
    timings: SessionTimings = msgspec.field(default_factory=SessionTimings)
    # options.numcheck "exact", "sampled" or "directional": the check of this batch's gradient (before clipping),
    # as POST /gradients runs it; null otherwise ("auto" is off in a session: a check costs many passes).
    numcheck: Numcheck | None = None
    # options.diagnostics ["norms"]: the batch gradient's norms (before clipping); the per-example diagnostics
    # need per-sample gradients, which a session step does not compute.
    diagnostics: Diagnostics | None = None
    # The `return` entries left out because the answer would have been over GRADSVC_MAX_RESULT_BYTES once the
    # call was applied (its outputs' size is known only then); the call was applied: read the weights with
    # GET /sessions/{id}/weights.
    omitted: list[str] = []
    # A session over several workers: each member's part of this call (forward_backward and step).
    members: list[MemberTimings] | None = None


class SessionInfo(Struct):
    """GET /sessions/{id}: where the session stands."""

    session_id: str
    step: int
    accumulated: int
    optimizer: OptimizerSpec
    parameter_count: int
    state_bytes: int
    device: str
    worker: str
    checkpoint_step: int | None
    checkpoint_every: int
    run: str | None
    created_at: float
    last_used_at: float
    last: SessionStepResult | None = None
    members: list[str] = []  # a session over several workers: the workers holding it, rank 0 first
