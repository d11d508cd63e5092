"""A training session on a worker (pure PyTorch): the model prepared once and kept on its device, a torch.optim
optimizer over its trainable parameters, the optimizer steps taken and the seed its random numbers come from.
step() is forward, backward, the clip and optimizer.step() as a local loop runs them (the equivalence tests hold
it to torch.optim's own numbers); forward_backward() sums gradients until optim_step(); state() and restore()
carry it all as named tensors (session_state.py) for a checkpoint.

Each batch goes through prepare() as a POST /gradients body would, with the session's model held in place
(`held`): the same validation, the same passes (passes.run_pass), the same clip (clip_grad_norm_'s factor).
A failed call changes nothing: gradients are added and buffers kept only once the pass succeeded.

Random numbers: the pass of optimizer step s, accumulation a, draws its dropout masks from seed + s * 2^16 + a
(model.seed at creation), so a replayed step draws the same masks, and the RNG state is two integers.
"""

from __future__ import annotations

import time
from types import MappingProxyType
from dataclasses import dataclass, field

import msgspec
import torch
from torch import nn

from gradsvc.wire import ClipOptions, ClipResult, Diagnostics, GradientRequest, GraphSpec, ModelSpec, Numcheck, \
    Options, SessionBatch, SessionCreate, by_reference

from . import logprobs, replicas, session_state, tensors
from .config import EngineCaches, EngineConfig, state_bytes
from .decode import loss_terms
from .devices import float32_math, math_mode_for, sync
from .diagnostics.clip import CLIP_EPS
from .diagnostics.norms import norms as norms_of
from .errors import ComputeError, EngineError, SpecError
from .frozen import FrozenStore
from .graph.interpreter import buffers_of, sharing
from .losses import OWN_LOSS
from .numcheck import CheckInputs, numerical_check
from .passes import forward_only, run_pass
from .prepare import Held, model_dtype, prepare_held
from .prepare_graph import GraphSpecModel
from .prepare_layers import LayerSpecModel
from .prepared import GraphResolver, Prepared

# Options of POST /gradients a session step cannot honour as /gradients does (each would change the state
# otherwise, or answers what /gradients answers): field -> its default, which a step must leave it at.
_REFUSED = MappingProxyType({"input_grad": False, "hvp": None, "graph": False, "per_sample": "off", "shards": 1,
                             "timing_repeat": 1, "batch_gradient": True, "curvature": None, "freeze": []})
# The idempotency keys a session remembers (in its checkpoint too): a retry comes within a few steps.
APPLIED_KEYS = 256


@dataclass
class StepOutcome:
    """What one call did: the batch's loss (forward_backward, step), the update's figures (optim_step, step)."""

    loss: float | None = None
    losses: dict[str, float] | None = None
    grad_norm: float | None = None
    lr: float | None = None
    clip: ClipResult | None = None
    gradients: dict[str, torch.Tensor] | None = None  # what the optimizer used: summed, clipped
    outputs: list | None = None
    prep: Prepared | None = None
    check: Numcheck | None = None  # options.numcheck's check of the batch's gradient
    diagnostics: Diagnostics | None = None  # options.diagnostics ["norms"] of the batch's gradient
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    extra: dict = field(default_factory=dict)


class TrainingSession:
    """The state one worker holds for a session, and the operations on it."""

    def __init__(self, create: SessionCreate, model: nn.Module, graph: tuple[str, GraphSpec] | None,
                 config: EngineConfig, caches: EngineCaches, device: torch.device) -> None:
        # Its body without the weights' bytes: the model holds them (and the frozen base is the worker's store's)
        self.create = msgspec.structs.replace(create, model=msgspec.structs.replace(create.model, weights=None))
        self.model, self.device = model, device
        self.graph_ref, self.graph = graph if graph is not None else (None, None)
        self.config, self.caches = config, caches
        frozen = set(create.options.freeze)
        unknown = frozen - {n for n, _ in model.named_parameters()}
        if unknown:
            raise SpecError("bad_option", f"options.freeze names {sorted(unknown)[:8]}, which are not parameters of "
                            "the model; name parameters as named_parameters() does", option="options.freeze")
        self.params = {n: p.requires_grad_(n not in frozen) for n, p in model.named_parameters() if n not in frozen}
        self.names = list(self.params)
        session_state.check_arguments(create.optimizer, {p.dtype for p in self.params.values()})
        self.optimizer = session_state.make_optimizer(create.optimizer, list(self.params.values()))
        self.step, self.accumulated, self.seed = 0, 0, create.model.seed
        self.applied: dict[str, int] = {}  # idempotency key -> the step it was applied at (the latest APPLIED_KEYS)
        self.answer_bytes: dict[str, int] = {}  # idempotency key -> its kept answer's bytes
        # The last update's per-parameter (|w_t - w_(t-1)|^2, |w_(t-1)|^2), kept by optim_step(norms=True): the
        # next run step's update_ratio, as a /gradients run's step t compares the weights it sent with step t-1's.
        self.last_update: dict[str, tuple[float, float]] | None = None
        self.parameter_count = sum(p.numel() for p in model.parameters())
        self.shared: set[str] = set()  # frozen parameters held in the worker's FrozenStore (open_session)
        self.group: replicas.Group | None = None  # its members' process group, when several workers hold it

    def math(self, asked: str | None = None):
        """The float32 math an operation runs in, as a job's (devices.float32_math): the batch's options.math_mode,
        else the worker's GRADSVC_FLOAT32_MATH; full float32 unless TF32 is asked for and the device has it, so a
        session's steps equal local torch.optim steps in full float32 on a GPU too."""
        return float32_math(math_mode_for(self.device, asked or self.config.float32_math), self.device)

    @property
    def state_bytes(self) -> int:
        """The device bytes it holds itself: weights and buffers (not the frozen ones it shares: FrozenStore), the
        optimizer's state, gradients accumulating."""
        held = self._own_bytes()
        for per in self.optimizer.state.values():
            held += sum(v.numel() * v.element_size() for v in per.values() if isinstance(v, torch.Tensor))
        return held + sum(p.grad.numel() * p.grad.element_size() for p in self.params.values() if p.grad is not None)

    @property
    def expected_bytes(self) -> int:
        """What it will hold once stepping: weights and buffers, and per trained parameter one gradient and the
        optimizer's tensors (created by its first step)."""
        trained = sum(p.numel() * p.element_size() for p in self.params.values())
        return self._own_bytes() + trained * (1 + session_state.optimizer_slots(self.create.optimizer))

    def _own_bytes(self) -> int:
        return state_bytes({n: t for n, t in self.model.state_dict().items() if n not in self.shared})

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # --- operations ------------------------------------------------------------------------------------

    def forward_backward(self, batch: SessionBatch) -> StepOutcome:
        """Forward and backward over the batch; its gradients are added to those waiting for optim_step. A session
        over several workers (`group`) runs its member's part of the rows, and the parts' gradients and losses are
        summed over the members (engine/replicas.py) before they are added."""
        request = self._request(batch)
        before = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        failed: EngineError | None = None
        try:
            prep = prepare_held(request, self.config, self.device, self.model, graphs=self._graphs,
                                caches=self.caches, held=Held(parts=self.group.size if self.group is not None else 1))
            if prep.graph is not None and prep.graph.first_output != 0:
                raise SpecError("bad_loss", "loss: a session trains on the graph's first output; name it as the "
                                "loss, or export the module with the loss first", option="loss")
            done = run_pass(prep, self.params, self.device, record_memory=False, hvp_vector=None,
                            seed=self._pass_seed(), part=_member_part(self, prep))
            _refuse_non_finite(done.grads, done.loss)
            check = numerical_check(CheckInputs(prep, request, self.config, self.device, done.grads, final=done)) \
                if prep.options.numcheck != "off" else None
        except BaseException as exc:
            self._put_buffers(before)  # a layer spec's training forward wrote them in place
            if self.group is None or not isinstance(exc, EngineError):
                raise
            failed = exc
        extra = {}
        if self.group is not None:
            self.group.agree(failed)  # raises on every member when one failed
            done.grads, done.losses, extra["allreduce_s"] = replicas.reduce_pass(
                self.group, self.names, done.grads, {**done.losses, "": done.loss}, self.params)
            done.loss = done.losses.pop("")
        if done.buffers:  # a graph's pass reports what its forward wrote and puts the old values back
            self._put_buffers(done.buffers)
        if self.group is not None:
            self.group.broadcast_buffers(self.model)
            extra["rows"] = _member_part(self, prep)
        for name, grad in done.grads.items():
            p = self.params[name]
            p.grad = grad.detach() if p.grad is None else p.grad.add_(grad)
        self.accumulated += 1
        diagnosed = Diagnostics(norms=norms_of(done.grads)) if prep.options.diagnostics else None
        return StepOutcome(loss=done.loss, losses=dict(done.losses) if len(prep.terms) > 1 else None,
                           outputs=done.outputs, prep=prep, forward_s=done.forward_s, backward_s=done.backward_s,
                           check=check, diagnostics=diagnosed, extra=extra)

    def forward(self, batch: SessionBatch) -> StepOutcome:
        return forward_alone(self, batch)

    def optim_step(self, lr: float | None = None, clip: ClipOptions | None = None, *,
                   norms: bool = False) -> StepOutcome:
        """The accumulated gradients clipped (as clip_grad_norm_), optimizer.step(), the gradients zeroed.
        `norms`: each parameter's squared gradient norm before clipping, in extra["squares"], and the update before
        this one (last_update), in extra["update"] (a run's step: its update_ratio)."""
        if self.accumulated == 0:
            raise SpecError("nothing_accumulated", f"optim_step: no gradient waits for an update (step {self.step}); "
                            "call forward_backward with a batch first, or send the batch to /step")
        started = time.perf_counter()
        grads = {n: p.grad for n, p in self.params.items() if p.grad is not None}
        total = torch.nn.utils.get_total_norm(list(grads.values()), 2.0)
        if not tensors.all_finite(total):
            raise ComputeError("non_finite", f"the accumulated gradient's norm is {float(total)}; nothing was applied "
                               "and the gradients are kept: call optim_step with a clip, or delete the session")
        squares = None
        if norms:
            flat = torch.stack([g.detach().to(torch.float64).pow(2).sum() for g in grads.values()])
            squares = dict(zip(grads, flat.tolist()))
        clip = clip or self.create.options.clip
        result = None
        if clip is not None:
            scale = torch.clamp(clip.max_norm / (total + CLIP_EPS), max=1.0)
            for g in grads.values():
                g.mul_(scale.to(g.dtype))
            result = ClipResult(total_norm=float(total), scale=float(scale))
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        before = {n: p.detach().clone() for n, p in self.params.items()} if norms else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step, self.accumulated = self.step + 1, 0
        previous = self.last_update
        if before is not None:
            self.last_update = self._update_squares(before)
        sync(self.device)
        return StepOutcome(grad_norm=float(total), lr=self.lr, clip=result, gradients=grads,
                           optimizer_s=time.perf_counter() - started, extra={"squares": squares, "update": previous})

    def _update_squares(self, before: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
        """Per parameter (frozen ones too, as a run's weights carry them): the squared norm of what the update
        moved and of the weights before it, in float64."""
        names = [n for n, _ in self.model.named_parameters()]
        with torch.no_grad():
            old = [before[n] if n in before else p.detach() for n, p in self.model.named_parameters()]
            moved = [(p.detach().to(torch.float64) - w.to(torch.float64)).pow(2).sum() if n in before else
                     torch.zeros((), dtype=torch.float64, device=w.device)
                     for (n, p), w in zip(self.model.named_parameters(), old)]
            base = [w.to(torch.float64).pow(2).sum() for w in old]
            pairs = torch.stack([torch.stack(moved), torch.stack(base)], dim=1).tolist() if names else []
        return {n: (m, b) for n, (m, b) in zip(names, pairs)}

    def train_step(self, batch: SessionBatch, *, norms: bool = False) -> StepOutcome:
        """forward_backward then optim_step (with whatever forward_backward had accumulated before); a failed
        update leaves the gradients as they were before this batch."""
        kept = {n: (p.grad.clone() if p.grad is not None else None) for n, p in self.params.items()} \
            if self.accumulated else None
        passed = self.forward_backward(batch)
        try:
            done = self.optim_step(batch.lr, batch.options.clip, norms=norms)
        except BaseException:
            self.accumulated -= 1
            for n, p in self.params.items():
                p.grad = kept[n] if kept is not None else None
            raise
        passed.grad_norm, passed.lr, passed.clip, passed.gradients = done.grad_norm, done.lr, done.clip, done.gradients
        passed.optimizer_s, passed.extra = done.optimizer_s, {**passed.extra, **done.extra}
        return passed

    # --- state -------------------------------------------------------------------------------------------

    def remember(self, key: str, answer_bytes: int = 0, budget: int | None = None) -> tuple[str, ...]:
        """Marks an idempotency key applied at the current step, its answer `answer_bytes` long; the oldest keys
        are forgotten past APPLIED_KEYS, or while the answers kept come to more than `budget` bytes (the newest
        is always kept). Answers the keys forgotten: their answers go with them (session_records.commit)."""
        self.applied[key] = self.step
        self.answer_bytes[key] = answer_bytes
        forgotten = []
        while len(self.applied) > 1 and (len(self.applied) > APPLIED_KEYS or
                                         budget is not None and sum(self.answer_bytes.values()) > budget):
            old = next(iter(self.applied))
            self.applied.pop(old)
            self.answer_bytes.pop(old, None)
            forgotten.append(old)
        return tuple(forgotten)

    @property
    def dtypes(self) -> set[torch.dtype]:
        """The dtypes of its trained parameters, the arithmetic its optimizer runs in."""
        return {p.dtype for p in self.params.values()}

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        out, meta = session_state.export_state(self.model, self.optimizer, self.names,
                                               {"step": self.step, "accumulated": self.accumulated, "seed": self.seed},
                                               skip=self.shared)
        meta["applied"] = msgspec.json.encode(self.applied).decode()
        meta["answer_bytes"] = msgspec.json.encode(self.answer_bytes).decode()
        if self.last_update is not None:
            meta["last_update"] = msgspec.json.encode(self.last_update).decode()
        return out, meta

    def restore(self, tensors_: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        counters = session_state.import_state(self.model, self.optimizer, self.names, tensors_, meta,
                                              shared=self.shared)
        self.step, self.accumulated, self.seed = counters["step"], counters["accumulated"], counters["seed"]
        self.applied = msgspec.json.decode(meta.get("applied", "{}"), type=dict[str, int])
        self.answer_bytes = msgspec.json.decode(meta.get("answer_bytes", "{}"), type=dict[str, int])
        last = meta.get("last_update")
        self.last_update = None if last is None else msgspec.json.decode(last, type=dict[str, tuple[float, float]])

    # --- helpers -----------------------------------------------------------------------------------------

    def _pass_seed(self) -> int:
        return (self.seed + (self.step << 16) + self.accumulated) % (1 << 63)

    def _graphs(self, ref: str) -> GraphSpec | None:
        return self.graph

    def _put_buffers(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, buffer in buffers_of(self.model, list(values)).items():
                buffer.copy_(values[name])

    def _request(self, batch: SessionBatch, forward: bool = False) -> GradientRequest:
        """The batch as a POST /gradients body over the session's model (no weights: the model is held);
        `forward`: for a forward alone (one pass over the whole batch, every output of a graph kept)."""
        opts = validate_step_options(batch.options, self.create.options.device)
        if forward:
            validate_forward(batch)
        m = self.create.model
        model = ModelSpec(layers=m.layers, graph_ref=self.graph_ref, dtype=m.dtype, seed=self._pass_seed())
        numcheck = "off" if opts.numcheck == "auto" or forward else opts.numcheck  # a check costs many passes
        opts = msgspec.structs.replace(opts, numcheck=numcheck, memory=False, freeze=list(self.create.options.freeze),
                                       clip=None)
        if forward:
            opts = msgspec.structs.replace(opts, micro_batch=None, outputs=self.graph is not None)
        return GradientRequest(model=model, inputs=batch.inputs, targets=batch.targets, loss=batch.loss,
                               losses=batch.losses, options=opts)


def forward_alone(session: TrainingSession, batch: SessionBatch) -> StepOutcome:
    """The batch's forward alone, as the next forward_backward would run it (the same model, its draws from
    the same seed), without a backward: nothing changes (weights, buffers, gradients, step). Its loss when the
    batch gives targets (or the model's own loss), every output, and per class-index loss the log-probability
    of each target (extra["logprobs"])."""
    request = session._request(batch, forward=True)
    own = any(t.type == OWN_LOSS for t in loss_terms(request))
    labels = None
    if own and batch.targets is not None:  # read against the logits (logprobs.of_labels), not by the loss
        labels = logprobs.decode_labels(batch.targets, session.config.limits.max_elements)
        request = msgspec.structs.replace(request, targets=None)
    prep = prepare_held(request, session.config, session.device, session.model, graphs=session._graphs,
                        caches=session.caches, held=Held(loss=own or batch.targets is not None))
    before = {n: b.detach().clone() for n, b in session.model.named_buffers()} if prep.graph is None else {}
    try:
        done = forward_only(prep, session.device, session._pass_seed())
    finally:
        session._put_buffers(before)  # a layer spec's training forward wrote them in place
    total = sum(t.weight * done.losses[t.name] for t in prep.terms) if prep.terms else None
    if labels is not None:
        done.logprobs[prep.terms[0].name] = logprobs.of_labels(done.outputs, labels)
    return StepOutcome(loss=total, losses=done.losses if len(prep.terms) > 1 else None, outputs=done.outputs,
                       prep=prep, forward_s=done.seconds, extra={"logprobs": done.logprobs})


def _member_part(session: TrainingSession, prep: Prepared) -> tuple[int, int] | None:
    """A member's rows of the batch (None: the session is on one worker)."""
    if session.group is None:
        return None
    if prep.options.numcheck != "off":
        raise SpecError("bad_option", "options.numcheck: a session over several workers checks no part's "
                        "gradient; leave it out, or check on POST /gradients with the session's weights (GET "
                        "/sessions/{id}/weights)", option="options.numcheck")
    if any(t.type == OWN_LOSS for t in prep.terms):
        raise SpecError("bad_loss", "loss 'output': the model's own loss is one scalar over the whole batch, "
                        "which a session over several workers cannot split into its parts; return per-example "
                        "outputs and use a built-in loss", option="loss")
    return session.group.part(prep.inputs.rows)


def validate_step_options(opts: Options, device: str) -> Options:
    """Refuses the options of POST /gradients a session step does not run, each with what to do instead."""
    for name, default in _REFUSED.items():
        if getattr(opts, name) != default:
            where = "options.freeze of POST /sessions" if name == "freeze" else \
                "POST /gradients with the session's weights (GET /sessions/{id}/weights)"
            raise SpecError("bad_option", f"options.{name}: a session step does not take it; leave it out (use "
                            f"{where} for it)", option=f"options.{name}")
    if opts.clip is not None and opts.clip.per_sample:
        raise SpecError("bad_option", "options.clip.per_sample: a session clips the batch's gradient (global); "
                        "leave per_sample out", option="options.clip")
    others = [d for d in opts.diagnostics if d != "norms"]
    if others:
        raise SpecError("bad_option", f"options.diagnostics {others}: a session step computes no per-example "
                        "gradients, which these need; ask for 'norms' alone, or use POST /gradients on the session's "
                        "weights (GET /sessions/{id}/weights)", option="options.diagnostics")
    if opts.device not in ("auto", device):
        raise SpecError("bad_option", f"options.device={opts.device!r}: the session lives on {device!r}; leave "
                        "options.device out of a step", option="options.device")
    return opts


def validate_forward(batch: SessionBatch) -> None:
    """Refuses what a forward does not do: an update (`lr`), a gradient (`return` gradients, numcheck,
    diagnostics, clip), or changed state to read (`return` weights or buffers: GET /sessions/{id}/weights)."""
    opts = batch.options
    asked = [r for r in batch.returns if r != "outputs"]
    refused = [("lr", batch.lr is not None), ("return", bool(asked)),
               ("options.numcheck", opts.numcheck not in ("auto", "off")),
               ("options.diagnostics", bool(opts.diagnostics)),
               ("options.clip", opts.clip is not None)]
    for name, given in refused:
        if given:
            what = f"return {asked}" if name == "return" else name
            raise SpecError("bad_option", f"{what}: a forward computes no gradient and changes nothing; leave it out "
                            "(it answers the loss, the log-probabilities and, with return ['outputs'], the "
                            "outputs; read the weights with GET /sessions/{id}/weights)", option=name)


def _refuse_non_finite(grads: dict[str, torch.Tensor], loss: float) -> None:
    for name, g in grads.items():
        if not tensors.all_finite(g):
            raise ComputeError("non_finite", f"the gradient of {name!r} holds NaN or infinite values while the loss "
                               f"is {loss}; nothing was applied. Lower the inputs' scale or the learning rate",
                               parameter=name)


def open_session(create: SessionCreate, config: EngineConfig, caches: EngineCaches, device: torch.device, *,
                 graphs: GraphResolver | None = None, restoring: bool = False,
                 frozen: FrozenStore | None = None) -> TrainingSession:
    """The session's model built on `device` with its weights (a layer spec's missing ones from its seeded
    default initialisation), and its optimizer. `restoring`: the weights will come from a checkpoint
    (TrainingSession.restore), so the request's are not read, but for the frozen ones sent by reference, which
    no checkpoint holds. `frozen`: the worker's store, which holds those once for every session naming them."""
    if create.options.clip is not None and create.options.clip.per_sample:
        raise SpecError("bad_option", "options.clip.per_sample: a session clips the batch's gradient (global); "
                        "leave per_sample out", option="options.clip")
    spec = msgspec.structs.replace(create.model, weights=None) if restoring else create.model
    request = GradientRequest(model=spec, inputs=[])
    dtype = model_dtype(request)  # a floating dtype, and exactly one of layers, graph, graph_ref
    base = by_reference(create.model.weights, set(create.options.freeze))  # bytes too, where the worker filled them
    if spec.layers is not None:
        model = LayerSpecModel(request, config, caches, dtype).model(device, False)[0]
        graph = None
    else:
        side = GraphSpecModel(request, config, caches, dtype, graphs)
        graph = (side.template.ref, side.template.spec)
        # The frozen weights this worker holds already (for its other sessions) are taken as they are: no copy
        held = frozen.held_for(side.meta, base, device) if frozen is not None else {}
        model = sharing(side.template.compiled, device=device, dtype=dtype, shared=held) if restoring else \
            side.model_sharing(device, held) if held else side.model(device, False)[0]
    shared = set()
    if frozen is not None:
        shared = frozen.share(model, base, config.limits.max_elements, loaded=not restoring)
    session = TrainingSession(create, model, graph, config, caches, device)
    session.shared = shared
    return session


def footprint(create: SessionCreate, config: EngineConfig, caches: EngineCaches,
              graphs: GraphResolver | None = None) -> tuple[int, int]:
    """(parameter count, the bytes the session will hold) checked on meta, as POST /sessions checks it before the
    queue: the model and its weights (as prepare checks them), the optimizer's arguments, options.freeze. The
    bytes: weights, buffers, the optimizer's per-parameter state and one gradient of every trained parameter."""
    if create.options.clip is not None and create.options.clip.per_sample:
        raise SpecError("bad_option", "options.clip.per_sample: a session clips the batch's gradient (global); "
                        "leave per_sample out", option="options.clip")
    session_state.optimizer_arguments(create.optimizer)
    request = GradientRequest(model=create.model, inputs=[])
    dtype = model_dtype(request)  # a floating dtype, and exactly one of layers, graph, graph_ref
    session_state.check_arguments(create.optimizer, dtype)
    side = LayerSpecModel(request, config, caches, dtype) if create.model.layers is not None else \
        GraphSpecModel(request, config, caches, dtype, graphs)
    meta = side.model("meta", False)[0]  # the weights decoded and checked
    names = dict(meta.named_parameters())
    unknown = set(create.options.freeze) - set(names)
    if unknown:
        raise SpecError("bad_option", f"options.freeze names {sorted(unknown)[:8]}, which are not parameters of "
                        "the model; name parameters as named_parameters() does", option="options.freeze")
    trained = sum(p.numel() for n, p in names.items() if n not in create.options.freeze) * dtype.itemsize
    base = by_reference(create.model.weights, set(create.options.freeze))  # counted with the key's tensor pieces
    own = {n: t for n, t in meta.state_dict().items() if n not in base}
    held = state_bytes(own) + trained * (1 + session_state.optimizer_slots(create.optimizer))
    return side.parameter_count, held
