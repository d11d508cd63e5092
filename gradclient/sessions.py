"""Training sessions from the SDK (docs/sessions.md): the weights and the optimizer stay on a worker, each step
sends only the batch.

    with client.session(model, optimizer="adamw", lr=3e-4, run="exp-1") as s:
        out = s.step(x, y)                      # loss, grad_norm, step
        s.forward_backward(x, y); s.optim_step()  # gradient accumulation
        s.forward(x, y).logprobs                # the forward alone: nothing changes
        s.pull(model)                           # the weights and buffers back into the local module

The session is created with its first batch (a module the layer spec cannot express goes as its exported graph,
which needs example inputs) and deleted when the `with` block ends. Every operation carries an idempotency key,
so a retry after a lost answer is answered again, never applied twice. Session and AsyncSession drive the same
flows, as Client and AsyncClient do."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from gradsvc import wire

from .base import Flow
from .request import Call, Outgoing
from .result import decode_tree, structured
from .retry import new_key
from .tensors import from_wire, inputs_to_wire, to_wire

OCTET_STREAM = "application/octet-stream"
# An operation the service still runs when its wait ended (202) is sent again under its key, this long after.
AGAIN_S = 0.05


class SessionOutput:
    """One operation's answer: `loss`, `grad_norm` (null on forward_backward), `step`, and what `return` asked for
    as torch tensors under the local module's names (`gradients`, `weights`, `buffers`), forward's `outputs` in
    its own structure; forward's `logprobs` (a tensor, or a dict by loss name for several losses); `raw` is the
    wire answer."""

    def __init__(self, raw: wire.SessionStepResult, names: dict[str, str], export: Any = None) -> None:
        self.raw = raw
        self.loss, self.losses, self.grad_norm, self.step = raw.loss, raw.losses, raw.grad_norm, raw.step
        self.accumulated, self.lr, self.resumed_from, self.replayed = raw.accumulated, raw.lr, raw.resumed_from, \
            raw.replayed
        self.gradients = _local(raw.gradients, names)
        self.weights = _local(raw.weights, names)
        self.buffers = _local(raw.buffers, names)
        self.outputs = structured(export, decode_tree(raw.outputs))
        logprobs = _local(raw.logprobs, {})
        self.logprobs = next(iter(logprobs.values())) if logprobs is not None and len(logprobs) == 1 else logprobs

    def __repr__(self) -> str:
        return f"SessionOutput(step={self.step}, loss={self.loss}, grad_norm={self.grad_norm})"


def _local(tensors: dict | None, names: dict[str, str]) -> dict | None:
    if tensors is None:
        return None
    return {names.get(n, n): (from_wire(t).clone() if t is not None else None) for n, t in tensors.items()}


@dataclass(frozen=True)
class SessionSettings:
    """client.session's keywords: the SDK's and POST /sessions's own (`run`, `clip`, ...), the rest the
    optimizer's (torch's argument names), in `optimizer` with its type."""

    optimizer: dict
    run: str | None = None
    clip: float | None = None
    dtype: str | None = None
    seed: int = 0
    device: str = "auto"
    checkpoint_every: int | None = None
    freeze: tuple = ()
    workers: int = 1  # data parallelism: the session held by this many workers (docs/sessions.md)
    wait_s: float = 60.0  # each call's server-side wait (the SDK sends it again, same key, past it)

    @classmethod
    def of(cls, optimizer: str, kwargs: dict[str, Any]) -> "SessionSettings":
        own = {f.name for f in fields(cls)} - {"optimizer"}
        mine = {k: v for k, v in kwargs.items() if k in own}
        args = {k: v for k, v in kwargs.items() if k not in own and v is not None}
        if "freeze" in mine:
            mine["freeze"] = tuple(mine["freeze"] or ())
        return cls(optimizer={"type": optimizer, **args}, **mine)

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device": self.device}
        if self.clip is not None:
            out["clip"] = {"max_norm": self.clip}
        if self.checkpoint_every is not None:
            out["checkpoint_every"] = self.checkpoint_every
        if self.freeze:
            out["freeze"] = list(self.freeze)
        if self.workers != 1:
            out["workers"] = self.workers
        return out


class BaseSession:
    """A session's settings and flows; `session_id` once its first batch created it."""

    def __init__(self, client: Any, model: Any, optimizer: str = "adamw", **kwargs: Any) -> None:
        self.client, self.model = client, model
        self.settings = SessionSettings.of(optimizer, kwargs)
        self.session_id: str | None = None
        self.created: wire.SessionCreated | None = None
        self.names: dict[str, str] = {}  # the service's parameter names -> the local module's
        self.export: Any = None  # the graph the session was created from (its output structure)
        self.steps = 0  # the optimizer steps the session applied, as its last answer said

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.session_id!r}, steps={self.steps})"

    @property
    def _path(self) -> str:
        return f"/sessions/{self.session_id}"

    def _creating(self, inputs: Any) -> Flow[None]:
        """POST /sessions with the model (its large weights uploaded first, by reference)."""
        client = self.client
        settings = self.settings
        out = client._prepare(Call(self.model, inputs, dtype=settings.dtype, seed=settings.seed))
        yield from client._uploading(out)
        options = settings.options()
        freeze = out.body.get("options", {}).get("freeze")
        if freeze and "freeze" not in options:
            options["freeze"] = freeze
        body = {"model": out.body["model"], "optimizer": settings.optimizer, "options": options}
        if settings.run is not None:
            body["run"] = settings.run
        response, buf = yield from client._sending(
            "POST", "/sessions", content=Outgoing(body=body, encoder=client._encoder, local_names={}),
            params={"wait": settings.wait_s}, extra_s=settings.wait_s, idempotency_key=new_key())
        self.created = client._reader.decode(wire.SessionCreated, response, buf)
        self.session_id, self.names, self.export = self.created.session_id, out.local_names, out.export

    def _operating(self, op: str, body: dict[str, Any], inputs: Any = None) -> Flow[SessionOutput]:
        """One operation under one idempotency key, sent again (same key) while the service answers 202."""
        if self.session_id is None:
            if inputs is None:
                raise ValueError(f"{op}: the session is created with its first batch; call step or "
                                 "forward_backward first")
            yield from self._creating(inputs)
        client, key = self.client, new_key()
        content = Outgoing(body=body, encoder=client._encoder, local_names={})
        while True:
            wait = self.settings.wait_s
            response, buf = yield from client._sending("POST", f"{self._path}/{op}", content=content,
                                                       params={"wait": wait}, extra_s=wait, idempotency_key=key)
            if response.status_code != 202:
                break
            yield AGAIN_S
        answer = SessionOutput(client._reader.decode(wire.SessionStepResult, response, buf), self.names, self.export)
        self.steps = answer.step
        return answer

    def _batch(self, inputs: Any, targets: Any, loss: Any, lr: float | None, returns: list[str] | None,
               options: dict[str, Any]) -> dict[str, Any]:
        fmt = self.client.wire_format
        body: dict[str, Any] = {"inputs": inputs_to_wire(inputs, fmt), "loss": loss, "options": options}
        if targets is not None:
            body["targets"] = to_wire(targets, fmt)
        if lr is not None:
            body["lr"] = lr
        if returns:
            body["return"] = list(returns)
        return body

    def _state(self) -> Flow[dict]:
        """GET /sessions/{id}/weights: the weights and buffers as torch tensors, under the local names."""
        tensors = yield from self.client._getting(f"{self._path}/weights", dict[str, wire.Tensor])
        return _local(tensors, self.names)

    def _saving(self, path: str) -> Flow[None]:
        """The weights and buffers as one safetensors file at `path` (as the service writes it); for a `peft`
        model, its adapter as `peft` saves it: `path` a directory with adapter_model.safetensors and
        adapter_config.json, which PeftModel.from_pretrained loads (the base is not in it)."""
        if _is_peft(self.model):
            state = yield from self._state()
            self.model.save_pretrained(path, state_dict=state)
            return
        response, buf = yield from self.client._sending("GET", f"{self._path}/weights",
                                                        accept=OCTET_STREAM)
        with open(path, "wb") as f:
            f.write(bytes(buf))

    def _pulling(self, model: Any) -> Flow[Any]:
        import torch

        state = yield from self._state()
        own = dict(model.state_dict(keep_vars=True))
        covered = {id(t) for n, t in own.items() if n in state}  # a tied weight goes under its first name
        missing = [n for n, t in own.items() if n not in state and id(t) not in covered]
        if missing:
            raise KeyError(f"pull: the session has no weights for {missing[:8]}; pull into the module the session "
                           "was created from")
        with torch.no_grad():
            for name, t in own.items():
                if name in state:
                    t.copy_(state[name])
        return model

    def _info(self) -> Flow[wire.SessionInfo]:
        return (yield from self.client._getting(self._path, wire.SessionInfo))

    def _deleting(self) -> Flow[None]:
        if self.session_id is not None:
            yield from self.client._sending("DELETE", self._path)
            self.session_id = None


class Session(BaseSession):
    """client.session(model, optimizer, lr=..., run=...): step(), forward_backward(), forward(), optim_step(),
    pull(model), state_dict(), save(path), info(), delete(); a context manager that deletes the session at its
    end."""

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.delete()

    def step(self, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *, lr: float | None = None,
             returns: list[str] | None = None, **options: Any) -> SessionOutput:
        """Forward, backward, clip and the optimizer step on the session's worker: the loss and grad_norm."""
        return self.client._drive(self._operating("step", self._batch(inputs, targets, loss, lr, returns, options),
                                                  inputs))

    def forward_backward(self, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                         returns: list[str] | None = None, **options: Any) -> SessionOutput:
        """Forward and backward; the gradients add up on the worker until optim_step()."""
        return self.client._drive(self._operating("forward_backward",
                                                  self._batch(inputs, targets, loss, None, returns, options), inputs))

    def forward(self, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                returns: list[str] | None = None, **options: Any) -> SessionOutput:
        """The forward alone, nothing changed: the loss (with targets, or the model's own), `logprobs` of
        class-index targets, and with returns=["outputs"] the outputs."""
        return self.client._drive(self._operating("forward", self._batch(inputs, targets, loss, None, returns,
                                                                         options), inputs))

    def optim_step(self, *, lr: float | None = None, returns: list[str] | None = None) -> SessionOutput:
        body: dict[str, Any] = {} if lr is None else {"lr": lr}
        if returns:
            body["return"] = list(returns)
        return self.client._drive(self._operating("optim_step", body))

    def pull(self, model: Any) -> Any:
        """Writes the session's weights and buffers into `model` (the local module it was created from)."""
        return self.client._drive(self._pulling(model))

    def state_dict(self) -> dict:
        return self.client._drive(self._state())

    def save(self, path: str) -> None:
        self.client._drive(self._saving(path))

    def info(self) -> wire.SessionInfo:
        return self.client._drive(self._info())

    def delete(self) -> None:
        self.client._drive(self._deleting())


class AsyncSession(BaseSession):
    """Session's methods as coroutines (AsyncClient.session); `async with` deletes the session at its end."""

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.delete()

    async def step(self, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *, lr: float | None = None,
                   returns: list[str] | None = None, **options: Any) -> SessionOutput:
        return await self.client._drive(self._operating("step", self._batch(inputs, targets, loss, lr, returns,
                                                                            options), inputs))

    async def forward_backward(self, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                               returns: list[str] | None = None, **options: Any) -> SessionOutput:
        return await self.client._drive(self._operating(
            "forward_backward", self._batch(inputs, targets, loss, None, returns, options), inputs))

    async def forward(self, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                      returns: list[str] | None = None, **options: Any) -> SessionOutput:
        return await self.client._drive(self._operating("forward", self._batch(inputs, targets, loss, None, returns,
                                                                               options), inputs))

    async def optim_step(self, *, lr: float | None = None, returns: list[str] | None = None) -> SessionOutput:
        body: dict[str, Any] = {} if lr is None else {"lr": lr}
        if returns:
            body["return"] = list(returns)
        return await self.client._drive(self._operating("optim_step", body))

    async def pull(self, model: Any) -> Any:
        return await self.client._drive(self._pulling(model))

    async def state_dict(self) -> dict:
        return await self.client._drive(self._state())

    async def save(self, path: str) -> None:
        await self.client._drive(self._saving(path))

    async def info(self) -> wire.SessionInfo:
        return await self.client._drive(self._info())

    async def delete(self) -> None:
        await self.client._drive(self._deleting())


def _is_peft(model: Any) -> bool:
    """A `peft` model (PeftModel and its task classes), known by what it has rather than imported."""
    return hasattr(model, "peft_config") and callable(getattr(model, "save_pretrained", None)) and \
        hasattr(model, "base_model")
