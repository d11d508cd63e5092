"""The RQ job of a training session's operation (docs/sessions.md): create, step, forward_backward, optim_step and
weights, run by the worker that holds the session (workers/session_host.py), each answered as MessagePack under
the job's answer key (gradsvc/broker/session_records.py) in RQ's success transaction; a failure is a coded error
as for a gradient job. A step under an idempotency key the session applied already is answered again, not run."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import msgspec
import torch
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import get_current_job
from rq.job import Job
from rq.timeouts import JobTimeoutException

from gradsvc.broker import affinity, keys
from gradsvc.broker.job import GradientJob
from gradsvc.broker.runs import RunBounds, RunStore
from gradsvc.broker.session_records import (COMMITTED, GONE, JOB_ANSWER_TTL_S, SessionRecord, SessionRecords,
                                            job_answer_name)
from gradsvc.engine import ComputeError, EngineError, SpecError, tensors
from gradsvc.engine import replicas, session_state
from gradsvc.engine.session import StepOutcome, TrainingSession, open_session
from gradsvc.engine.session_state import check_step_values
from gradsvc.wire import (GradientRequest, RunCheck, RunStep, SessionBatch, SessionCreate, SessionCreated,
                          MemberTimings, SessionOptimStep, SessionStepResult, SessionTimings, by_reference, refs_only)

from .jobs import WorkerContext, _fail, _graphs, _with_pieces, context_of
from .run_steps import module_of
from .session_group import Membership, check_member, form, goes_on, holding, reports
from .session_host import default_checkpoint_every

log = logging.getLogger("gradsvc.worker")
_encoder = msgspec.msgpack.Encoder()
_decoders = {
    kind: {"json": msgspec.json.Decoder(kind), "msgpack": msgspec.msgpack.Decoder(kind)}
    for kind in (SessionCreate, SessionBatch, SessionOptimStep)
}


@dataclass
class Call:
    """One operation as the job runs it."""

    job: Job
    ctx: WorkerContext
    records: SessionRecords
    session_id: str
    body: bytes
    fmt: str
    started: float
    key: str | None = None  # the Idempotency-Key header's (a body's idempotency_key wins)
    read: bytes | None = None  # the record's bytes as record() read them: what the commit compares
    member: Membership | None = None  # a session over several workers: this job's part (session_group.py)

    @property
    def writes(self) -> bool:
        """Whether this job writes the record and the answer: a session's only worker, or rank 0 of several."""
        return self.member is None or self.member.rank == 0

    def decode(self, kind):
        try:
            return _decoders[kind][self.fmt].decode(self.body)
        except msgspec.ValidationError as exc:
            raise SpecError("invalid_body", f"the request does not match the schema: {exc}") from None
        except msgspec.DecodeError as exc:
            raise SpecError("malformed_body", f"the request body is not valid {self.fmt}: {exc}") from None

    def record(self) -> SessionRecord:
        rec, self.read = self.records.read(self.session_id)
        if rec is None:
            raise SpecError("not_found", f"no session {self.session_id!r}: it was deleted, or went unused for longer "
                            "than GRADSVC_SESSION_IDLE_TTL_S; create a new one (POST /sessions)",
                            session_id=self.session_id)
        return rec


def session_job(session_id: str, op: str, body: bytes, fmt: str, key: str | None = None,
                group: dict | None = None) -> dict:
    """Runs one operation on a session; its answer goes to the job's answer key as MessagePack. `group`: a session
    over several workers, this job's part (session_group.Membership)."""
    job = get_current_job()
    assert job is not None, "session jobs run inside an RQ worker"
    ctx = context_of(job)
    s = ctx.settings
    records = SessionRecords(job.connection, s.queue_prefix, s.session_idle_ttl_s, job.worker_name or "")
    call = Call(job, ctx, records, session_id, body, fmt, time.perf_counter(), key, member=Membership.of(group))
    ctx.metrics.busy.set(1)
    try:
        if call.member is not None:
            check_member(records.worker, call.member)
        data = _OPS[op](call)
        if op != "delete" and call.writes:  # nobody waits on a delete's answer, nor on a member's but rank 0's
            key = keys.training_session_answer_key(s.queue_prefix, session_id, job_answer_name(job.id))
            ttl = min(s.result_ttl_s, JOB_ANSWER_TTL_S)  # the API reads it once, and deletes it
            if isinstance(job, GradientJob):  # written in RQ's success transaction
                job.pending_result = (key, data, ttl)
            else:
                job.connection.set(key, data, ex=ttl)
    except EngineError as exc:
        if call.member is not None and not isinstance(exc, SpecError):  # its group may be broken: formed again
            ctx.sessions.sessions.pop(session_id, None)
        raise _fail(job, ctx, exc.code, exc.message, exc.detail, "session") from None
    except JobTimeoutException:
        raise _fail(job, ctx, "timeout", f"the session's {op} ran past its timeout of {job.timeout} s; send "
                    "smaller batches (or micro_batch)", kind="session") from None
    except (RedisConnectionError, RedisTimeoutError):
        raise
    except Exception as exc:  # a bug, not the user's input: reported as such, the worker kept alive
        log.exception("session job %s (%s) failed unexpectedly", job.id, op)
        raise _fail(job, ctx, "internal_error", f"the worker failed unexpectedly ({type(exc).__name__}); this "
                    "is a gradsvc bug, please report it with the request", kind="session") from None
    finally:
        ctx.metrics.busy.set(0)
        ctx.metrics.sessions_held.set(len(ctx.sessions.sessions))
        ctx.metrics.session_bytes.set(ctx.sessions.held_bytes)
    ctx.metrics.session_steps.labels(op).inc()
    return {"result_bytes": len(data)}


def _create(call: Call) -> bytes:
    ctx, rec = call.ctx, call.record()
    create = call.decode(SessionCreate)
    if create.options.device not in ("auto", ctx.device.type):
        raise SpecError("device_unavailable", f"options.device={create.options.device!r}: the worker that took the "
                        f"session runs on {ctx.device}; use device='auto' or start a {create.options.device} worker")
    group = _form(call) if call.member is not None else None
    failed = None
    try:
        ctx.sessions.room_for(call.session_id, call.records)
        session = _opened(call, create, restoring=False)
    except EngineError as exc:
        if group is None:
            raise
        failed = exc
    if group is not None:
        group.agree(failed)  # every member built its replica, or every one fails alike
        session.group = group
    rec.create = msgspec.structs.replace(create, model=msgspec.structs.replace(create.model, weights=refs_only(
        create.model.weights, set(create.options.freeze)) or None))  # the frozen base by its refs, to rebuild it
    ctx.sessions.sessions[call.session_id] = session
    _hold_base(call, rec.create)
    size = session.expected_bytes  # its optimizer's state comes with the first step
    every = create.options.checkpoint_every or ctx.settings.session_checkpoint_every or default_checkpoint_every(size)
    rec.holder, rec.device, rec.parameter_count, rec.state_bytes = call.records.worker, str(ctx.device), \
        session.parameter_count, size
    rec.checkpoint_every, rec.checkpoint_step, rec.last_used_at = every, 0, time.time()
    _write(call, rec, session_state.to_bytes(*session.state()) if call.writes else None)
    return _encoder.encode(SessionCreated(session_id=call.session_id, step=0, parameter_count=session.parameter_count,
                                          device=str(ctx.device), checkpoint_every=every, state_bytes=size))


def _hold_base(call: Call, create: SessionCreate) -> None:
    """Records this worker as the holder of the session's frozen base while it has room for another session, so
    that the next session of that base comes here (gradsvc/broker/affinity.py base_key); a full worker drops its
    record. Advisory: a record Redis did not take costs a later session a build of the base, nothing more."""
    key = affinity.base_key(create.model.dtype, by_reference(create.model.weights, set(create.options.freeze)))
    if key is None:
        return
    host, s, redis = call.ctx.sessions, call.ctx.settings, call.job.connection
    try:
        if len(host.sessions) < host.max_sessions:
            affinity.record_holder(redis, s.queue_prefix, affinity.BASES, key, call.records.worker,
                                   s.session_idle_ttl_s)
        else:
            affinity.drop_holder(redis, s.queue_prefix, affinity.BASES, key, call.records.worker)
    except (RedisConnectionError, RedisTimeoutError):
        return


def _session(call: Call, rec: SessionRecord) -> tuple[TrainingSession, int | None]:
    return call.ctx.sessions.held(call.session_id, rec, call.records, _reopen(call, rec))


def _reopen(call: Call, rec: SessionRecord):
    ctx = call.ctx

    def reopen() -> TrainingSession:
        """The session's model built again, for its checkpoint: its frozen base found in this worker's store, or
        fetched from the owner's pieces."""
        session = _opened(call, rec.create, restoring=True)
        _hold_base(call, rec.create)
        return session
    return reopen


def _opened(call: Call, create: SessionCreate, restoring: bool) -> TrainingSession:
    """open_session with the model's pieces filled in, but for the frozen weights this worker's store holds
    already (for its other sessions): neither fetched nor copied, the store's are taken (engine/frozen.py). Should
    the store hold them in another dtype than this session's, the session is built again with them fetched."""
    ctx = call.ctx
    frozen = ctx.sessions.frozen
    held = frozen.holding(create.model.weights, set(create.options.freeze), ctx.device) \
        if create.model.layers is None else {}  # kept (the store holds weakly) until the session holds them

    def build(keep: set[str]) -> TrainingSession:
        model = create.model
        if model.weights:
            model = _with_pieces(ctx, call.job, GradientRequest(model=model, inputs=[]), in_place=False,
                                 keep=keep).model
        return open_session(msgspec.structs.replace(create, model=model), ctx.engine.config, ctx.engine.caches,
                            ctx.device, graphs=_graphs(ctx, call.job), restoring=restoring, frozen=frozen)
    try:
        return build(set(held))
    except SpecError as exc:
        if not held or exc.code != "tensor_not_found":
            raise
    return build(set())


def _replayed(call: Call, session: TrainingSession, key: str | None) -> bytes | None:
    """The answer given when `key` was applied, marked replayed, when the session (as it stands) applied it. The
    answer is kept as long as the key is remembered (they are dropped together); should Redis have lost it, the
    step is not applied again: a coded 410 says so."""
    if key is None or key not in session.applied:
        return None
    raw = call.records.answer(call.session_id, key)
    if raw is None:
        raise SpecError("answer_lost", f"session {call.session_id} applied the call under idempotency key {key!r} "
                        f"at step {session.applied[key]}, but its answer is no longer kept (Redis lost it); it was "
                        "not applied again. Read where the session stands with GET /sessions/{id}; to apply the "
                        "batch again, send it under a new key", session_id=call.session_id, step=session.applied[key])
    answer = msgspec.msgpack.decode(raw, type=SessionStepResult)
    return _encoder.encode(msgspec.structs.replace(answer, replayed=True))


def _opened_call(call: Call, kind: type) -> tuple[SessionRecord, Any, TrainingSession, int | None]:
    """(the record as read, the body decoded as `kind`, the session as the record says it stands, the checkpoint's
    step when it was restored); a restore that lost steps is refused (_refuse_lost_steps)."""
    rec = call.record()
    payload = call.decode(kind)
    session, resumed = _session(call, rec) if call.member is None else _members_session(call, rec)
    if resumed is not None and (session.step, session.accumulated) != (rec.step, rec.accumulated):
        _refuse_lost_steps(call, rec, session)
    return rec, payload, session, resumed


def _operate(call: Call, op: str) -> bytes:
    """step, forward_backward or optim_step: the session as its record says, the call applied once, the
    record (a checkpoint when due, and the answer under the idempotency key) committed only when the record is
    still the one read (session_records.py), so that an answer is given only for a committed call."""
    rec, payload, session, resumed = _opened_call(call, SessionOptimStep if op == "optim_step" else SessionBatch)
    key = payload.idempotency_key or call.key
    failed, again = None, None
    try:
        again = _replayed(call, session, key) if call.writes else None
        check_step_values(payload.lr, session.dtypes)
        _refuse_too_large(call, session, payload)
        if isinstance(payload, SessionBatch):
            payload = _with_batch_pieces(call, rec, payload)
    except EngineError as exc:
        if session.group is None:
            raise
        failed = exc
    if session.group is not None:
        session.group.agree(failed)
        if session.group.rank0_says(again is not None):  # rank 0 applied it already: answered again, not run
            return again or b""
    elif again is not None:
        return again
    norms = rec.create.run is not None
    with session.math(payload.options.math_mode if isinstance(payload, SessionBatch) else None):
        if op == "forward_backward":
            outcome = session.forward_backward(payload)
        elif op == "optim_step":
            outcome = session.optim_step(payload.lr, None, norms=norms)
        else:
            outcome = session.train_step(payload, norms=norms)
    answer = _answer(call, session, outcome, payload.returns, resumed)
    if session.group is not None:
        answer = msgspec.structs.replace(answer, members=_member_timings(call, session, outcome))
    answer, data = _bounded(call, answer)
    forgotten = session.remember(key, len(data), call.ctx.settings.session_answer_bytes) if key is not None else ()
    _commit(call, rec, session, answer, op, (key, data) if key is not None else None, forgotten)
    if norms and op != "forward_backward" and call.writes:  # a session over several workers: rank 0's alone
        _record_run_step(call, rec, session, outcome, answer)
    return data


def _forward(call: Call) -> bytes:
    """The batch's forward alone (TrainingSession.forward): nothing of the session changes, so nothing is
    remembered under an idempotency key; the record is committed with this worker as the holder (a forward may
    have restored the session here) and its idle time restarted."""
    rec, payload, session, resumed = _opened_call(call, SessionBatch)
    _refuse_too_large(call, session, payload)
    payload = _with_batch_pieces(call, rec, payload)
    with session.math(payload.options.math_mode):
        outcome = session.forward(payload)
    answer = _answer(call, session, outcome, payload.returns, resumed)
    logprobs = outcome.extra["logprobs"]
    answer, data = _bounded(call, msgspec.structs.replace(answer, logprobs={
        n: tensors.encode(v) for n, v in logprobs.items()} if logprobs else None))
    rec.holder, rec.device, rec.last_used_at = call.records.worker, str(session.device), time.time()
    _write(call, rec, op="forward")
    return data


def _form(call: Call):
    s = call.ctx.settings
    return form(call.job.connection, s.queue_prefix, call.session_id, call.member, s.worker_address,
                s.session_collective_timeout_s)


def _members_session(call: Call, rec: SessionRecord) -> tuple[TrainingSession, int | None]:
    """A session over several workers: its replica and group as they stand when every member reports the same
    formation and step (session_group.py); else every member drops its own, forms a new group and restores the
    replica from the checkpoint (the checkpoint's step: the answer says so when steps after it were lost)."""
    m, host, s = call.member, call.ctx.sessions, call.ctx.settings
    held = host.sessions.get(call.session_id) if rec.members == list(m.members) else None
    mine = holding(held, m, (rec.step, rec.accumulated))
    said = reports(call.job.connection, s.queue_prefix, call.session_id, m, mine,
                   s.session_collective_timeout_s)
    if goes_on(said):
        return held, None
    host.sessions.pop(call.session_id, None)
    group, failed = _form(call), None
    try:
        session, resumed = host.restore(call.session_id, call.records, _reopen(call, rec))
    except EngineError as exc:
        failed = exc
    group.agree(failed)
    session.group = group
    return session, resumed


def _member_timings(call: Call, session: TrainingSession, outcome: StepOutcome) -> list[MemberTimings] | None:
    """Every member's rows, compute and all-reduce times for this call (a collective: every member asks)."""
    if "rows" not in outcome.extra:
        return None
    a, b = outcome.extra["rows"]
    allreduce_s = outcome.extra["allreduce_s"]
    call.ctx.metrics.member_phase.labels("compute").observe(outcome.forward_s + outcome.backward_s)
    call.ctx.metrics.member_phase.labels("allreduce").observe(allreduce_s)
    times = replicas.gather_times(session.group, b - a, outcome.forward_s + outcome.backward_s, allreduce_s)
    return [MemberTimings(worker=w, rows=rows, compute_ms=1e3 * c, allreduce_ms=1e3 * r)
            for w, (rows, c, r) in zip(call.member.members, times)]


def _with_batch_pieces(call: Call, rec: SessionRecord, batch: SessionBatch) -> SessionBatch:
    """The batch with its tensors by reference (`{"refs": [...]}`) filled in from the owner's pieces, as a
    POST /gradients job's are."""
    model = msgspec.structs.replace(rec.create.model, weights=None)  # the batch's pieces alone, not the base's
    request = _with_pieces(call.ctx, call.job, GradientRequest(model=model, inputs=batch.inputs, targets=batch.targets))
    return msgspec.structs.replace(batch, inputs=request.inputs, targets=request.targets)


def _refuse_too_large(call: Call, session: TrainingSession, payload: SessionBatch | SessionOptimStep) -> None:
    """A call whose answer would be over GRADSVC_MAX_RESULT_BYTES by the tensors it asks `return` for (their
    sizes are known before it runs) is refused before it is applied: a retry, or the same batch under a new key,
    applies it once."""
    limit, returns = call.ctx.settings.max_result_bytes, set(payload.returns)
    size = 0
    if "weights" in returns:
        size += sum(p.numel() * p.element_size() for p in session.model.parameters())
    if "buffers" in returns:
        size += sum(b.numel() * b.element_size() for b in session.model.buffers())
    if "gradients" in returns:
        gdtype = payload.options.gradient_dtype if isinstance(payload, SessionBatch) else None
        size += sum(p.numel() * (tensors.TORCH_DTYPES[gdtype].itemsize if gdtype else p.element_size())
                    for p in session.params.values())
    if size > limit:
        raise ComputeError("result_too_large", f"return: {sorted(returns)} would answer at least {size} bytes, above "
                           f"GRADSVC_MAX_RESULT_BYTES={limit}; the call was not applied. Ask for fewer `return` "
                           "entries and read the weights with GET /sessions/{id}/weights (Accept: "
                           "application/octet-stream)", result_bytes=size, limit=limit, applied=False)


def _bounded(call: Call, answer: SessionStepResult) -> tuple[SessionStepResult, bytes]:
    """The answer and its bytes; an answer over GRADSVC_MAX_RESULT_BYTES once applied (its outputs, whose size
    is known only then) comes without its tensors, named in `omitted`: the call was applied, and the weights
    can be read with GET /sessions/{id}/weights."""
    data = _encoder.encode(answer)
    if len(data) <= call.ctx.settings.max_result_bytes:
        return answer, data
    omitted = [f for f in ("gradients", "weights", "buffers", "outputs") if getattr(answer, f) is not None]
    answer = msgspec.structs.replace(answer, gradients=None, weights=None, buffers=None, outputs=None,
                                     omitted=omitted)
    return answer, _encoder.encode(answer)


def _refuse_lost_steps(call: Call, rec: SessionRecord, session: TrainingSession) -> None:
    """The session came back from a checkpoint older than where it stood (its worker died): the record now says
    where it stands, and the batch is refused, so that the client sends the lost steps' batches first, in order,
    and ends on the weights it would have had."""
    lost, at, passes = rec.step - session.step, session.step, rec.accumulated
    rec.step, rec.accumulated, rec.holder = session.step, session.accumulated, call.records.worker
    rec.device, rec.last_used_at = str(session.device), time.time()
    _write(call, rec)
    raise SpecError("session_resumed", f"session {call.session_id} was restored from its checkpoint at step {at} on "
                    f"worker {call.records.worker} (the worker that held it is gone); the {lost} optimizer steps "
                    f"after it (and {passes} accumulated passes) were lost, and this batch was not applied: "
                    f"send the batches of step {at} on again, in order", step=at, lost_steps=lost)


def _answer(call: Call, session: TrainingSession, outcome: StepOutcome, returns: list[str],
            resumed: int | None) -> SessionStepResult:
    prep = outcome.prep
    gdtype = prep.options.gradient_dtype if prep is not None else None
    grads = None
    if "gradients" in returns and outcome.gradients is not None:
        cast = tensors.TORCH_DTYPES[gdtype] if gdtype else None
        grads = {n: (tensors.encode(outcome.gradients[n].to(cast) if cast else outcome.gradients[n])
                     if n in outcome.gradients else None) for n, _ in session.model.named_parameters()}
    named = dict(session.model.named_buffers())
    return SessionStepResult(
        session_id=call.session_id, step=session.step, accumulated=session.accumulated, loss=outcome.loss,
        losses=outcome.losses, grad_norm=outcome.grad_norm, lr=session.lr, clip=outcome.clip, gradients=grads,
        weights={n: tensors.encode(p) for n, p in session.model.named_parameters()} if "weights" in returns else None,
        buffers={n: tensors.encode(b) for n, b in named.items()} if "buffers" in returns and named else None,
        outputs=_outputs(prep, outcome) if "outputs" in returns else None, device=str(session.device),
        worker=call.records.worker, resumed_from=resumed, numcheck=outcome.check, diagnostics=outcome.diagnostics,
        timings=SessionTimings(forward_ms=1e3 * outcome.forward_s, backward_ms=1e3 * outcome.backward_s,
                               optimizer_ms=1e3 * outcome.optimizer_s,
                               total_ms=1e3 * (time.perf_counter() - call.started)))


def _outputs(prep, outcome: StepOutcome):
    from gradsvc.engine import outputs

    if outcome.outputs is None or prep is None or (prep.graph is None and len(outcome.outputs) != 1):
        raise SpecError("bad_option", "return: 'outputs' returns a graph model's outputs with options.outputs=true "
                        "on a graph model (and any model's on /forward); set options.outputs or drop 'outputs' from "
                        "return", option="return")
    if prep.graph is None:  # a layer spec's forward: its one output
        return tensors.encode(outcome.outputs[0])
    return outputs.as_returned(outputs.tree_of(prep.graph.spec), outcome.outputs, prep.graph.first_output)


def _commit(call: Call, rec: SessionRecord, session: TrainingSession, answer: SessionStepResult, op: str,
            kept: tuple[str, bytes] | None, forgotten: tuple[str, ...]) -> None:
    """The record where the session stands now, with a checkpoint when one is due (every checkpoint_every
    optimizer steps) and the answer kept under its idempotency key."""
    due = op != "forward_backward" and session.step % max(1, rec.checkpoint_every) == 0 and call.writes
    rec.step, rec.accumulated, rec.holder = session.step, session.accumulated, call.records.worker
    rec.device, rec.state_bytes, rec.last_used_at = str(session.device), session.state_bytes, time.time()
    rec.last = msgspec.structs.replace(answer, gradients=None, weights=None, buffers=None, outputs=None)
    state = None
    if due:
        state = session_state.to_bytes(*session.state())
        rec.checkpoint_step = session.step
    _write(call, rec, state, kept, forgotten, op)
    call.ctx.sessions.steps_total += 1


def _write(call: Call, rec: SessionRecord, state: bytes | None = None, kept: tuple[str, bytes] | None = None,
           forgotten: tuple[str, ...] = (), op: str = "call") -> None:
    """Commits `rec` over the record this call read. When the session was deleted meanwhile, or another worker
    committed it since (two workers that restored it at once), nothing is written: this worker drops its copy,
    which is ahead of what Redis holds, and the call is refused as not applied (the API sends a conflicted call
    again, to the worker that holds the session now). Of a session over several workers rank 0 commits, with the
    members, and every member takes its outcome (a member whose replica went ahead of the record drops it)."""
    group = getattr(call.ctx.sessions.sessions.get(call.session_id), "group", None) if call.member else None
    outcome = COMMITTED
    if call.writes:
        if call.member is not None:
            rec.holder, rec.members = call.member.members[0], list(call.member.members)
        outcome = call.records.commit(call.session_id, call.read or b"", rec, state, kept, forgotten)
    error = None
    if outcome == GONE:
        error = SpecError("not_found", f"session {call.session_id} was deleted (or expired) while this {op} ran; it "
                          "was not applied", session_id=call.session_id)
    elif outcome != COMMITTED:
        error = ComputeError("session_conflict", f"session {call.session_id} was changed by another worker while this "
                             f"{op} ran on {call.records.worker} (it had been restored on both); this {op} was not "
                             "applied: send it again", session_id=call.session_id)
    if group is not None:
        try:
            group.agree(error)  # rank 0's outcome is every member's
        except EngineError:
            call.ctx.sessions.sessions.pop(call.session_id, None)
            raise
    if error is not None:
        call.ctx.sessions.sessions.pop(call.session_id, None)
        raise error


def _record_run_step(call: Call, rec: SessionRecord, session: TrainingSession, outcome: StepOutcome,
                     answer: SessionStepResult) -> None:
    """The optimizer step as a step of the session's run (GET /runs/{name}): its loss and gradient norms
    (before clipping) and the update ratio of the update before it (the weights this step's gradient was taken at
    against the previous step's, as a /gradients run records it), written in the job's success transaction."""
    s = call.ctx.settings
    modules = {}
    for name, sq in (outcome.extra.get("squares") or {}).items():
        modules[module_of(name)] = modules.get(module_of(name), 0.0) + sq
    check = outcome.check
    step = RunStep(step=session.step - 1, job_id=call.job.id, ended_at=datetime.now(timezone.utc).isoformat(),
                   loss=float(outcome.loss or 0.0), grad_norm=float(outcome.grad_norm or 0.0),
                   module_grad_norms={m: v ** 0.5 for m, v in modules.items()},
                   update_ratio=update_ratio(outcome.extra.get("update")), total_ms=answer.timings.total_ms,
                   losses=outcome.losses, clip=msgspec.to_builtins(outcome.clip) if outcome.clip is not None else None,
                   numcheck=None if check is None or check.mode == "off" else
                   RunCheck(check.mode, check.passed, check.max_rel_error))
    store = RunStore(call.job.connection, s.queue_prefix, RunBounds.from_settings(s))
    owner, name, job_id = rec.owner, rec.create.run, call.job.id

    def write(client) -> None:
        store.record(client, owner, job_id, step, name, numbered=True)
    call.job.pending_step = write


def update_ratio(update: dict[str, tuple[float, float]] | None) -> dict[str, float] | None:
    """{module: |w_t - w_(t-1)| / |w_(t-1)|} of the update before this step (docs/runs.md), from its per-parameter
    squares; None on the session's first step."""
    if update is None:
        return None
    moved: dict[str, float] = {}
    base: dict[str, float] = {}
    for name, (m, b) in update.items():
        module = module_of(name)
        moved[module], base[module] = moved.get(module, 0.0) + m, base.get(module, 0.0) + b
    return {m: (moved[m] / base[m]) ** 0.5 for m in moved if base[m] > 0}


def _weights(call: Call) -> bytes:
    """The session's weights and buffers: wire tensors (fmt "msgpack") or one safetensors file ("safetensors")."""
    rec = call.record()
    session, _ = _session(call, rec)
    state = session.model.state_dict()
    if call.fmt == "safetensors":
        return session_state.to_bytes({n: t.detach().to("cpu", copy=True).contiguous() for n, t in state.items()},
                                      {"step": str(session.step)})
    return _encoder.encode({n: tensors.encode(t) for n, t in state.items()})


def _delete(call: Call) -> bytes:
    """Frees what this worker holds of the session (the API deleted its record)."""
    call.ctx.sessions.sessions.pop(call.session_id, None)
    if call.ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return _encoder.encode({"deleted": call.session_id})


_OPS = {
    "create": _create,
    "step": lambda call: _operate(call, "step"),
    "forward_backward": lambda call: _operate(call, "forward_backward"),
    "optim_step": lambda call: _operate(call, "optim_step"),
    "forward": _forward,
    "weights": _weights,
    "delete": _delete,
}
