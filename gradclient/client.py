"""Client and AsyncClient (the same methods, sync and async, over httpx), and the Job handles they return.

Everything both share (building the body, decoding answers, mapping errors, the retry delay) lives in
_BaseClient; the two subclasses only send and sleep, as httpx's Client and AsyncClient do.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import anyio
import httpx
import msgspec
import numpy as np

from gradsvc import wire

from .errors import (
    BadOptionError,
    CanceledError,
    ConnectionFailedError,
    GradientClientError,
    GraphNotFoundError,
    TensorNotFoundError,
    UnsupportedModuleError,
    WaitTimeoutError,
    error_for,
)
from .result import GradientResult, build_result
from .refs import MIN_BYTES, TensorRefs
from .tensors import decode_type, inputs_to_wire, several_inputs, to_wire

DEFAULT_URL = "http://127.0.0.1:8000"
MSGPACK = "application/msgpack"
JSON = "application/json"
_OPTION_NAMES = frozenset(f.name for f in msgspec.structs.fields(wire.Options))
# Errors before the request reached the server: safe to send again whatever the method.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# Errors after it may have: retried for GET and DELETE, which create nothing, and for a POST only under
# its Idempotency-Key, which makes the service answer with the job the first attempt created.
_IDEMPOTENT_ERRORS = (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)
# 503 codes that mean "nothing ran, ask again"; worker_lost is a job that failed (perhaps by killing its
# worker): it reaches the caller as WorkerLostError and is never sent again.
_TRANSIENT_CODES = frozenset({"queue_unavailable", "not_ready"})
# The longest pause between two tries: an API back after a restart (`gradsvc up`: ~6 s) is found within it.
_MAX_DELAY_S = 2.0


# An answer at least this large is read into uninitialised memory from numpy, which asks Linux for huge
# pages: a 33.6 MB answer then takes ~530 page faults instead of ~8,200 and is not zeroed first (filling
# it 21 -> 4 ms on a 2-core VM).
_LARGE_ANSWER = 1 << 20


class _Body:
    """The answer's bytes in one writable buffer, sized from Content-Length: tensors are views into it."""

    def __init__(self, response: httpx.Response) -> None:
        length = response.headers.get("content-length")
        size = int(length) if length and length.isdigit() else 0
        self.buf: bytearray | memoryview
        if size >= _LARGE_ANSWER and "content-encoding" not in response.headers:
            self.buf = memoryview(np.empty(size, dtype=np.uint8))
        else:
            self.buf = bytearray(size)
        self.n = 0

    def add(self, chunk: bytes) -> None:
        end = self.n + len(chunk)
        if end > len(self.buf) and isinstance(self.buf, memoryview):  # longer than announced: grow as bytes
            self.buf = bytearray(self.buf[:self.n])
        self.buf[self.n:end] = chunk  # grows the buffer only when the length was unknown or encoded
        self.n = end

    def done(self) -> bytearray | memoryview:
        if self.n < len(self.buf):
            if isinstance(self.buf, memoryview):
                self.buf = self.buf[:self.n]
            else:
                del self.buf[self.n:]
        return self.buf


class _Prepared(msgspec.Struct):
    body: dict[str, Any]  # encoded when sent (_BaseClient._encoded), tensors as views of the caller's memory
    encoder: Any
    local_names: dict[str, str]
    graph_key: Any = None  # the export cache's key when the model went as a graph
    by_ref: bool = False  # sent as graph_ref, without the graph
    uploads: list = msgspec.field(default_factory=list)  # (sha256, bytes) of weight pieces to PUT first
    refs: list = msgspec.field(default_factory=list)  # every piece the body names by reference
    sent_bytes: int = 0  # the uploaded pieces' bytes
    body_bytes: int = 0  # the body's, once encoded

    @property
    def content(self) -> bytes:
        """The body encoded into fresh bytes."""
        return self.encoder.encode(self.body)


# A body at least this large is encoded into a buffer the client keeps from one request to the next and
# sent from it in pieces: encoding the 36 MB body of an 8 x 1024 MLP into fresh memory took 18-20 ms on a
# 2-core VM (its pages faulted in one by one; up to 95 ms while the kernel was short of free pages),
# into a buffer used before 2 ms. httpcore's h11 copies each piece into a bytes of its own, so a piece is
# 1 MiB (reused memory) rather than the whole body (another fresh 36 MB).
_KEPT_BUFFER_MIN = 1 << 20
_PIECE = 1 << 20


class _Pieces:
    """A body in the client's kept buffer, as 1 MiB views; iterable again for a retry."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view)

    def __iter__(self) -> Iterator[memoryview]:
        for i in range(0, len(self.view), _PIECE):
            yield self.view[i:i + _PIECE]


class _AsyncPieces(_Pieces):
    """The same for httpx.AsyncClient, which takes an async iterable."""

    __iter__ = None  # type: ignore[assignment]  (httpx would take a sync iterable for a sync stream)

    async def __aiter__(self):
        for i in range(0, len(self.view), _PIECE):
            yield self.view[i:i + _PIECE]


class _Export(msgspec.Struct):
    """One exported graph, cached per module structure and input signature (not per weights)."""

    graph: wire.GraphSpec
    names: list[str]  # its parameters' and buffers' state_dict names, in the graph's order
    ref: str | None = None  # the service's graph_ref, once an answer gave it


# Exports kept per client; each costs ~1 s of torch.export, so the cache is the point.
_EXPORTS_KEPT = 32


class _BaseClient:
    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 30.0,
                 retries: int | None = None, retry_for_s: float = 20.0, backoff_s: float = 0.25,
                 wire_format: str = "msgpack", headers: dict[str, str] | None = None,
                 ref_min_bytes: int | None = MIN_BYTES) -> None:
        if wire_format not in ("msgpack", "json"):
            raise ValueError(f"wire_format must be 'msgpack' or 'json', got {wire_format!r}")
        self.base_url = (base_url or os.environ.get("GRADSVC_URL") or DEFAULT_URL).rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("GRADSVC_API_KEY")
        self.timeout = timeout
        self.retries = retries  # None: as many as retry_for_s allows
        self.retry_for_s = retry_for_s
        self.backoff_s = backoff_s
        self.wire_format = wire_format
        media = MSGPACK if wire_format == "msgpack" else JSON
        self.headers = {"Accept": media, "Content-Type": media, **(headers or {})}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._encoder = msgspec.msgpack.Encoder() if wire_format == "msgpack" else msgspec.json.Encoder()
        self._buffer = bytearray()  # see _KEPT_BUFFER_MIN; one request at a time uses it (_buffer_lock)
        self._buffer_lock = threading.Lock()
        self._decoders: dict[tuple[Any, bool], Any] = {}
        self._exports: dict[Any, _Export] = {}
        # A module's weights of at least ref_min_bytes go up once, by reference (refs.py); None: in every body.
        self._refs = TensorRefs(ref_min_bytes) if ref_min_bytes is not None else None

    # --- requests ---------------------------------------------------------------------------------
    def _prepare(self, model: Any, inputs: Any, targets: Any, loss: Any, losses: list | None, dtype: str | None,
                 seed: int, options: dict[str, Any]) -> _Prepared:
        fmt = self.wire_format
        options = dict(options)
        local_names: dict[str, str] = {}
        uploads: list = []
        graph_key, by_ref = None, False
        if isinstance(model, wire.ModelSpec):
            model = msgspec.structs.asdict(model)
        if isinstance(model, dict):
            spec = dict(model)
            weights = spec.pop("weights", None)
            if weights:
                spec["weights"] = {k: to_wire(v, fmt) for k, v in weights.items()}
        else:
            from .convert import convert  # needs torch; spec dicts do not

            try:
                # A layer spec takes one tensor: a module called with several inputs goes as a graph.
                c = None if several_inputs(inputs) and _is_module(model) else convert(model)
            except UnsupportedModuleError:
                if not _is_module(model):
                    raise
                c = None
            if c is None:  # any other nn.Module goes as an exported graph with its weights
                spec, graph_key, by_ref = self._graph_spec(model, inputs, uploads)
                if "freeze" not in options:
                    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
                    if frozen:
                        options["freeze"] = frozen
            else:
                spec = {"layers": c.layers, "dtype": c.dtype}
                if c.weights:
                    spec["weights"] = {k: self._weight(v, uploads) for k, v in c.weights.items()}
                local_names = c.local_names
                if "freeze" in options:
                    options["freeze"] = _service_prefixes(options["freeze"], local_names)
                elif c.frozen:
                    options["freeze"] = c.frozen
        if dtype is not None:
            spec["dtype"] = dtype
        spec.setdefault("seed", seed)
        body: dict[str, Any] = {"model": spec, "inputs": inputs_to_wire(inputs, fmt), "options": self._options(options)}
        if targets is not None:
            body["targets"] = ({k: to_wire(v, fmt) for k, v in targets.items()} if isinstance(targets, dict)
                               else to_wire(targets, fmt))
        if losses is not None:
            body["losses"] = losses
        else:
            body["loss"] = loss
        refs = [r for w in spec.get("weights", {}).values() if isinstance(w, wire.Tensor) and w.refs for r in w.refs]
        return _Prepared(body=body, encoder=self._encoder, local_names=local_names, graph_key=graph_key,
                         by_ref=by_ref, uploads=uploads, refs=refs)

    def _weight(self, t: Any, uploads: list) -> Any:
        """A weight as the request carries it: by reference when large (its new pieces into `uploads`)."""
        if self._refs is not None:
            by_ref = self._refs.wire(t)  # the parameter itself: its version counter says when it changed
            if by_ref is not None:
                value, pending = by_ref
                uploads.extend(pending)
                return value
        return to_wire(t.detach(), self.wire_format)

    def _graph_spec(self, model: Any, inputs: Any, uploads: list) -> tuple[dict[str, Any], Any, bool]:
        """The model spec of a module the layer spec cannot express: its exported graph (or, once the
        service has answered for this structure, the graph's ref) and its current weights."""
        from .export import example_inputs, export_graph

        args, kwargs = example_inputs(inputs)
        rows = next(x.shape[0] for x in (*args, *kwargs.values()))
        key = _structure_key(model, args, kwargs)
        entry = self._exports.get(key)
        if entry is None:  # a model export could not make batch-dynamic is kept per batch size
            entry = self._exports.get((*key, rows))
            key = key if entry is None else (*key, rows)
        if entry is None:
            exported = export_graph(model, args, kwargs)  # UnsupportedModuleError with torch's reason
            entry = _Export(graph=exported.graph, names=list(exported.weights))
            key = key if exported.dynamic_batch else (*key, rows)
            if len(self._exports) >= _EXPORTS_KEPT:
                self._exports.pop(next(iter(self._exports)))
            self._exports[key] = entry
        state = {**dict(model.named_parameters(remove_duplicate=False)),
                 **dict(model.named_buffers(remove_duplicate=False))}
        weights = {n: self._weight(state[n], uploads) for n in entry.names}
        spec: dict[str, Any] = {"dtype": entry.graph.dtype, "weights": weights}
        if entry.ref is not None:
            spec["graph_ref"] = entry.ref
        else:
            spec["graph"] = entry.graph
        return spec, key, entry.ref is not None

    def _remember(self, prepared: _Prepared, graph_ref: str | None) -> None:
        """After an answer: the next request for this structure sends graph_ref, not the graph."""
        entry = self._exports.get(prepared.graph_key) if prepared.graph_key is not None else None
        if entry is not None and graph_ref:
            entry.ref = graph_ref

    def _answer(self, prepared: _Prepared, response: httpx.Response, buf: bytearray | memoryview) -> "GradientResult | str":
        """A POST /gradients answer: the result (200), or the id of the job to wait on (202)."""
        if response.status_code == 200:
            return build_result(self._decode(wire.GradientResult, response, buf), prepared.local_names)
        return self._decode(wire.JobAccepted, response, buf).job_id

    @staticmethod
    def _job_to_wait_on(exc: GradientClientError) -> str:
        """The job a POST that failed after creating it names (the caller waits on it, never POSTs again)."""
        if not _resumable(exc):
            raise exc
        return exc.job_id

    def _finished(self, prepared: _Prepared, result: GradientResult) -> GradientResult:
        self._remember(prepared, result.graph_ref)
        result.upload_bytes = prepared.body_bytes + prepared.sent_bytes
        return result

    def _lost(self, prepared: _Prepared, exc: GradientClientError) -> bool:
        """Whether the request is worth sending again after `exc`: a graph sent by ref (the graph goes
        whole next), or pieces the service lost (they go up again next)."""
        if isinstance(exc, GraphNotFoundError):
            return self._forget(prepared)
        if prepared.refs and self._refs is not None:
            self._refs.forget(prepared.refs)
            return True
        return False

    def _forget(self, prepared: _Prepared) -> bool:
        """The service no longer knows the graph sent by ref: True when the request is worth one resend
        with the whole graph."""
        entry = self._exports.get(prepared.graph_key) if prepared.graph_key is not None else None
        if entry is None or not prepared.by_ref:
            return False
        entry.ref = None
        return True

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - _OPTION_NAMES)
        if unknown:
            raise BadOptionError(f"unknown option(s) {unknown}; the options are {sorted(_OPTION_NAMES)}",
                                 detail={"options": unknown})
        hvp = options.get("hvp")
        if isinstance(hvp, dict) and isinstance(hvp.get("vector"), dict):
            options["hvp"] = {**hvp, "vector": {k: to_wire(v, self.wire_format) for k, v in hvp["vector"].items()}}
        if self.wire_format == "json":
            options.setdefault("encoding", "b64")  # never nested lists: b64 decodes straight to bytes
        return options

    @contextlib.contextmanager
    def _encoded(self, kw: dict[str, Any], pieces: type[_Pieces]) -> Iterator[dict[str, Any]]:
        """`kw` with a _Prepared `content` encoded, for as long as the request (and its retries) runs: into
        the kept buffer when no other request of this client holds it, else into fresh bytes."""
        prepared = kw.get("content")
        if not isinstance(prepared, _Prepared):
            yield kw
            return
        if not self._buffer_lock.acquire(blocking=False):
            content = prepared.content
            prepared.body_bytes = len(content)
            yield {**kw, "content": content}
            return
        view = None
        try:
            try:
                self._encoder.encode_into(prepared.body, self._buffer)
            except BufferError:  # a view of it outlived its request (a caller kept one): leave it to them
                self._buffer = bytearray()
                self._encoder.encode_into(prepared.body, self._buffer)
            prepared.body_bytes = len(self._buffer)
            if len(self._buffer) < _KEPT_BUFFER_MIN:
                yield {**kw, "content": bytes(self._buffer)}
            else:
                view = memoryview(self._buffer)
                yield {**kw, "content": pieces(view)}
        finally:
            if view is not None:
                try:
                    view.release()
                except BufferError:
                    self._buffer = bytearray()
            self._buffer_lock.release()

    def _request(self, method: str, path: str, *, content: bytes | _Pieces | None = None,
                 params: dict | None = None, extra_s: float = 0.0, idempotency_key: str | None = None,
                 key_age_s: float | None = None) -> httpx.Request:
        timeout = httpx.Timeout(self.timeout + extra_s, connect=min(self.timeout, 10.0))
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        if idempotency_key and key_age_s is not None:
            # A retry: the service refuses it (job_lost) if Redis lost its data since the first try, whose
            # job may have run, rather than run it a second time under a key it no longer knows.
            headers["Idempotency-Key-Age"] = f"{key_age_s:.3f}"
        if isinstance(content, _Pieces):  # a stream of known length: Content-Length, not chunked
            headers["Content-Length"] = str(len(content))
        return self._http.build_request(method, path, content=content, params=params, timeout=timeout,
                                        headers=headers or None)

    # --- answers ----------------------------------------------------------------------------------
    def _decode(self, tp: Any, response: httpx.Response, buf: bytearray | memoryview) -> Any:
        is_msgpack = response.headers.get("content-type", "").startswith(MSGPACK)
        decoder = self._decoders.get((tp, is_msgpack))
        if decoder is None:
            kind = msgspec.msgpack if is_msgpack else msgspec.json
            decoder = self._decoders[(tp, is_msgpack)] = kind.Decoder(decode_type(tp))
        try:
            return decoder.decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise GradientClientError(f"could not read the answer to {response.request.method} "
                                      f"{response.request.url.path}: {exc}", code="bad_response",
                                      response=response) from None

    def _error(self, response: httpx.Response, buf: bytearray | memoryview) -> GradientClientError:
        # Streamed responses keep no body; the exception's response carries it for the caller.
        response = httpx.Response(response.status_code, headers=response.headers, content=bytes(buf),
                                  request=response.request)
        try:
            body = self._decode(wire.ErrorBody, response, bytearray(buf))
        except GradientClientError:
            return GradientClientError(f"HTTP {response.status_code} from {response.request.url}: "
                                       f"{response.text[:300]}", code=f"http_{response.status_code}",
                                       response=response)
        detail = dict(body.error.detail)
        if body.job_id:
            detail.setdefault("job_id", body.job_id)
        return error_for(body.error.code, body.error.message, detail, response)

    def _job_error(self, info: Any) -> GradientClientError:
        if info.error is None:
            return CanceledError(f"job {info.job_id} was canceled", detail={"job_id": info.job_id})
        detail = {**info.error.detail, "job_id": info.job_id}
        return error_for(info.error.code, info.error.message, detail)

    def _delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        delay = min(self.backoff_s * 2**attempt, _MAX_DELAY_S) * random.uniform(0.8, 1.2)
        retry_after = response.headers.get("retry-after") if response is not None else None
        if retry_after:
            try:
                delay = max(delay, float(retry_after))
            except ValueError:
                pass
        return delay

    @staticmethod
    def _replayable(method: str, path: str, kw: dict[str, Any]) -> bool:
        """Whether sending the request again cannot create a second job. POST /estimate creates nothing."""
        return method != "POST" or path == "/estimate" or kw.get("idempotency_key") is not None

    @staticmethod
    def _age(attempt: int, started: float) -> dict[str, float]:
        return {"key_age_s": time.monotonic() - started} if attempt else {}

    def _budget_left(self, attempt: int, started: float, delay: float) -> bool:
        """Whether another try fits: within `retries` (when set) and, its pause included, within
        `retry_for_s` of the first try."""
        if self.retries is not None and attempt >= self.retries:
            return False
        return time.monotonic() - started + delay <= self.retry_for_s

    def _may_retry(self, exc: Exception, attempt: int, replayable: bool, started: float, delay: float) -> bool:
        if not self._budget_left(attempt, started, delay):
            return False
        return isinstance(exc, _CONNECT_ERRORS) or (replayable and isinstance(exc, _IDEMPOTENT_ERRORS))

    def _may_retry_503(self, response: httpx.Response, body: _Body, attempt: int, replayable: bool,
                       started: float, delay: float) -> bool:
        if response.status_code != 503 or not replayable or not self._budget_left(attempt, started, delay):
            return False
        try:
            error = self._decode(wire.ErrorBody, response, body.done())
        except GradientClientError:
            return True  # not the API's answer (a proxy's): nothing ran behind it
        if error.job_id or error.error.detail.get("job_id"):
            # A job exists (Redis went away while the request waited on it): the caller waits on that job
            # (GET /jobs/{id}) rather than sending the POST again, which, were the Idempotency-Key's record
            # lost with Redis's data, would run the request a second time.
            return False
        return error.error.code in _TRANSIENT_CODES

    def _connection_failed(self, method: str, path: str, exc: Exception, attempts: int,
                           started: float) -> ConnectionFailedError:
        return ConnectionFailedError(f"{method} {self.base_url}{path} failed after {attempts} tries over "
                                     f"{time.monotonic() - started:.1f} s (retry_for_s={self.retry_for_s}): "
                                     f"{type(exc).__name__}: {exc}", detail={"attempts": attempts})


def _resumable(exc: GradientClientError) -> bool:
    """A POST /gradients that failed transiently (Redis away while it waited) after its job was created:
    the answer names the job, which the caller then waits on."""
    return exc.code in _TRANSIENT_CODES and exc.job_id is not None


def _new_key() -> str:
    """One Idempotency-Key per gradients()/submit() call, kept across that call's retries."""
    return str(uuid.uuid4())


def _service_prefixes(prefixes: list[str], local_names: dict[str, str]) -> list[str]:
    """`freeze` prefixes given in the local model's names ("fc1") as the service's ("0")."""
    out = []
    for p in prefixes:
        hits = [s for s, loc in local_names.items() if loc == p or loc.startswith(p.rstrip(".") + ".")]
        out.extend(hits or [p])
    return out


def _is_module(model: Any) -> bool:
    try:
        from torch import nn
    except ImportError:
        return False
    return isinstance(model, nn.Module)


def _structure_key(model: Any, args: tuple, kwargs: dict) -> tuple:
    """What an export depends on: the module's class and configuration, its tensors' names, shapes and
    dtypes, train/eval mode, and each input's name, dtype and shape (past the batch dimension for the
    batched ones: export makes it dynamic). Not the weights' values: those go with every request."""
    from .export import batched_inputs

    tensors = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in
                    [*model.named_parameters(), *model.named_buffers()])
    modes = tuple(m.training for m in model.modules())
    xs = [*args, *kwargs.values()]
    attributes = tuple(_plain_attributes(m) for m in model.modules())
    shapes = tuple((str(x.dtype), tuple(x.shape[1:]) if b else tuple(x.shape), b)
                   for x, b in zip(xs, batched_inputs(xs)))
    return (type(model), repr(model), tensors, modes, tuple(kwargs), shapes, attributes)


_PLAIN = (int, float, bool, str, type(None))


def _plain_attributes(module: Any) -> tuple:
    """A module's own public attributes that forward may read and repr() does not show: numbers, strings
    and flags by value, classes and functions (a custom autograd Function it applies) by name."""
    import torch

    out = []
    for k, v in vars(module).items():
        if k.startswith("_") or isinstance(v, (torch.Tensor, torch.nn.Module)):
            continue
        if isinstance(v, _PLAIN):
            out.append((k, v))
        elif isinstance(v, type) or callable(v):
            out.append((k, f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', type(v).__qualname__)}"))
        else:
            out.append((k, type(v).__qualname__))
    return tuple(out)


def _call_seed(model: Any) -> int:
    """A module's call draws its seed (its dropout masks) from torch's global generator, as a local
    training step would draw its masks: `torch.manual_seed` makes a whole run reproducible. A spec dict
    keeps seed 0 (for a layer spec without weights it also seeds the initial weights)."""
    if not _is_module(model):
        return 0
    import torch

    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))


class _Progress:
    """A tqdm bar showing the job's phase and its done/total (plain lines on stderr without tqdm)."""

    def __init__(self, enabled: bool, job_id: str) -> None:
        self.bar = None
        self.enabled = enabled
        self.last = ""
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=0, desc=f"job {job_id[:8]} queued", unit="step", leave=False)
            except ImportError:
                pass

    def update(self, info: Any) -> None:
        if not self.enabled:
            return
        p = info.progress
        phase = p.phase if p is not None and info.status == "started" else info.status
        if self.bar is not None:
            self.bar.set_description_str(phase, refresh=False)
            if p is not None:
                self.bar.total, self.bar.n = p.total, p.done
            self.bar.refresh()
        elif phase != self.last:
            print(f"job {info.job_id}: {phase}", file=sys.stderr)
        self.last = phase

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Poll:
    """How long to wait between GET /jobs/{id}: 20 ms, growing to 0.5 s, capped by the caller's deadline."""

    def __init__(self, timeout: float | None) -> None:
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.interval = 0.02

    def next(self, job_id: str) -> float:
        delay, self.interval = self.interval, min(self.interval * 1.5, 0.5)
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError(f"job {job_id} did not end within the timeout; it goes on: wait again with "
                                       f"client.job({job_id!r}).result(), or stop it with "
                                       f"client.job({job_id!r}).cancel()", detail={"job_id": job_id})
            delay = min(delay, left)
        return delay


class _Deadline:
    """gradients()' `timeout` as one deadline over the POST's server-side wait (`wait_s`) and the polling after it."""

    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def wait(self, wait_s: float) -> float:
        """The POST's `wait`: `wait_s`, cut to what the deadline leaves."""
        left = self.left()
        return wait_s if left is None else min(wait_s, left)


def _outcome(client: _BaseClient, info: Any, local_names: dict[str, str]) -> GradientResult | None:
    if info.status == "finished":
        return build_result(info.result, local_names)
    if info.status in ("failed", "canceled"):
        raise client._job_error(info)
    return None


class Client(_BaseClient):
    """The sync SDK client. `Client(base_url, api_key=None, timeout=30.0, retry_for_s=20.0)`; a context manager.

    A request that could not reach the API (or got a transient 503) is tried again with backoff (0.25 s
    doubling to 2 s) for up to `retry_for_s` seconds in all, which covers an API restart (`gradsvc up`: ~6 s);
    `retries` also caps the number of tries again when set.

    `wire_format="msgpack"` (raw tensor bytes, the default) or "json"; `transport` is an httpx transport
    (e.g. httpx.MockTransport in tests). base_url and api_key default to $GRADSVC_URL and $GRADSVC_API_KEY.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 30.0,
                 retries: int | None = None, retry_for_s: float = 20.0, backoff_s: float = 0.25,
                 wire_format: str = "msgpack",
                 headers: dict[str, str] | None = None, transport: httpx.BaseTransport | None = None,
                 ref_min_bytes: int | None = MIN_BYTES) -> None:
        super().__init__(base_url, api_key, timeout=timeout, retries=retries, retry_for_s=retry_for_s,
                         backoff_s=backoff_s, ref_min_bytes=ref_min_bytes,
                         wire_format=wire_format, headers=headers)
        self._http = httpx.Client(base_url=self.base_url, headers=self.headers, transport=transport)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        self._buffer = bytearray()

    def _send(self, method: str, path: str, **kw: Any) -> tuple[httpx.Response, bytearray | memoryview]:
        with self._encoded(kw, _Pieces) as kw:
            return self._send_encoded(method, path, **kw)

    def _send_encoded(self, method: str, path: str, **kw: Any) -> tuple[httpx.Response, bytearray | memoryview]:
        attempt, started = 0, time.monotonic()
        replayable = self._replayable(method, path, kw)
        while True:
            try:
                response = self._http.send(self._request(method, path, **kw, **self._age(attempt, started)), stream=True)
                try:
                    body = _Body(response)
                    for chunk in response.iter_bytes():
                        body.add(chunk)
                finally:
                    response.close()
            except httpx.TransportError as exc:
                delay = self._delay(attempt)
                if not self._may_retry(exc, attempt, replayable, started, delay):
                    raise self._connection_failed(method, path, exc, attempt + 1, started) from exc
                time.sleep(delay)
                attempt += 1
                continue
            delay = self._delay(attempt, response) if response.status_code == 503 else 0.0
            if self._may_retry_503(response, body, attempt, replayable, started, delay):
                time.sleep(delay)
                attempt += 1
                continue
            if response.status_code >= 400:
                raise self._error(response, body.done())
            return response, body.done()

    def gradients(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                  losses: list | None = None, dtype: str | None = None, seed: int | None = None, wait_s: float = 30.0,
                  timeout: float | None = None, progress: bool = False, **options: Any) -> GradientResult:
        """The gradients of `loss(model(inputs), targets)` for every parameter, computed by the service.

        `model`: an nn.Module of allow-listed layers (its weights go with it) or a spec dict; `options`
        are those of docs/api.md (numcheck="off", memory=False, per_sample="norms", ...). Waits for the job up
        to `timeout` seconds in all (None: as long as it takes), then raises WaitTimeoutError; `wait_s` is how
        long the POST itself waits on the server (its `?wait=`, cut to what `timeout` leaves) before polling
        GET /jobs/{id}.
        """
        deadline = _Deadline(timeout)  # the whole call's: the export, the server-side wait and the polling
        seed = _call_seed(model) if seed is None else seed  # drawn once: a resend repeats it
        args = (model, inputs, targets, loss, losses, dtype, seed, options)
        return self._resending(args, lambda prepared: self._gradients(prepared, wait_s, deadline, progress))

    def _resending(self, args: tuple, call: Callable[[_Prepared], Any]) -> Any:
        """call(the request prepared, its new pieces uploaded); once more, prepared anew, when the service
        answers that it lost the graph or a piece the request names (_lost)."""
        prepared = self._prepare(*args)
        self._upload(prepared)
        try:
            return call(prepared)
        except (GraphNotFoundError, TensorNotFoundError) as exc:
            if not self._lost(prepared, exc):
                raise
            prepared = self._prepare(*args)
            self._upload(prepared)
            return call(prepared)

    def _upload(self, prepared: _Prepared) -> None:
        for ref, data in prepared.uploads:
            if ref not in self._refs.uploaded:
                self._send("PUT", f"/tensors/{ref}", content=_Pieces(data))
                self._refs.uploaded.add(ref)
                prepared.sent_bytes += len(data)

    def _gradients(self, prepared: _Prepared, wait_s: float, deadline: _Deadline, progress: bool) -> GradientResult:
        wait = deadline.wait(wait_s)
        try:
            answer = self._answer(prepared, *self._send("POST", "/gradients", content=prepared, params={"wait": wait},
                                                        extra_s=wait, idempotency_key=_new_key()))
        except GradientClientError as exc:
            answer = self._job_to_wait_on(exc)
        if isinstance(answer, str):
            answer = Job(self, answer, prepared.local_names).result(timeout=deadline.left(), progress=progress)
        return self._finished(prepared, answer)

    def submit(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
               losses: list | None = None, dtype: str | None = None, seed: int | None = None, **options: Any) -> "Job":
        """Queues the request and returns at once with its Job."""
        seed = _call_seed(model) if seed is None else seed  # drawn once: a resend repeats it
        args = (model, inputs, targets, loss, losses, dtype, seed, options)
        # One POST per body, each under its own key: a refused one made no job.
        prepared, (response, buf) = self._resending(args, lambda p: (p, self._send(
            "POST", "/gradients", content=p, params={"wait": 0}, idempotency_key=_new_key())))
        if response.status_code == 200:  # a server that answered anyway: keep the result in the handle
            raw = self._decode(wire.GradientResult, response, buf)
            self._remember(prepared, raw.graph_ref)
            return Job(self, raw.job_id, prepared.local_names, done=build_result(raw, prepared.local_names))
        return Job(self, self._decode(wire.JobAccepted, response, buf).job_id, prepared.local_names,
                   prepared=prepared)

    def job(self, job_id: str) -> "Job":
        """A handle on a job submitted earlier (tensor names as the service gives them)."""
        return Job(self, job_id)

    def estimate(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                 losses: list | None = None, dtype: str | None = None, seed: int = 0,
                 **options: Any) -> wire.Estimate:
        """Parameter count and per-layer activation memory, predicted on the meta device; nothing is queued."""
        args = (model, inputs, targets, loss, losses, dtype, seed, options)
        response, buf = self._resending(args, lambda p: self._send("POST", "/estimate", content=p))
        return self._decode(wire.Estimate, response, buf)

    def layers(self) -> list[wire.LayerInfo]:
        response, buf = self._send("GET", "/layers")
        return self._decode(list[wire.LayerInfo], response, buf)

    def health(self, ready: bool = False) -> dict[str, Any]:
        """GET /healthz ({"status": "ok"}); with ready=True GET /readyz (Redis and a live worker)."""
        response, buf = self._send("GET", "/readyz" if ready else "/healthz")
        return self._decode(dict[str, Any], response, buf)


class Job:
    """A submitted request (`job_id`; `id` is its alias): status(), cancel(), result(timeout=None, progress=False)."""

    def __init__(self, client: Client, job_id: str, local_names: dict[str, str] | None = None, *,
                 done: GradientResult | None = None, prepared: _Prepared | None = None) -> None:
        self.client = client
        self.job_id = job_id
        self.local_names = local_names or {}
        self._done = done
        self._prepared = prepared  # a graph model's request: its answer's graph_ref goes to the export cache

    @property
    def id(self) -> str:
        """An alias of `job_id` (the name the wire and the errors use), kept for code written against `id`."""
        return self.job_id

    def __repr__(self) -> str:
        return f"Job({self.job_id!r})"

    def info(self) -> Any:
        """GET /jobs/{id}: status, progress {phase, done, total}, error, timestamps (and the raw result)."""
        response, buf = self.client._send("GET", f"/jobs/{self.job_id}")
        return self.client._decode(wire.JobInfo, response, buf)

    def status(self) -> str:
        """queued | started | finished | failed | canceled"""
        return self.info().status

    def cancel(self) -> str:
        """DELETE /jobs/{id}: a queued job is canceled at once, a running one at its next step."""
        response, buf = self.client._send("DELETE", f"/jobs/{self.job_id}")
        return self.client._decode(wire.JobInfo, response, buf).status

    def result(self, timeout: float | None = None, progress: bool = False) -> GradientResult:
        """Waits for the job: the result, or the job's error raised as its exception class
        (WaitTimeoutError past `timeout`; the job goes on). progress=True shows the job's phase."""
        if self._done is not None:
            return self._done
        poll, bar = _Poll(timeout), _Progress(progress, self.job_id)
        try:
            while True:
                info = self.info()
                bar.update(info)
                result = _outcome(self.client, info, self.local_names)
                if result is not None:
                    self._done = result
                    if self._prepared is not None:
                        self.client._remember(self._prepared, result.graph_ref)
                    return result
                time.sleep(poll.next(self.job_id))
        finally:
            bar.close()


class AsyncClient(_BaseClient):
    """Client's methods as coroutines: `async with AsyncClient(url) as c: r = await c.gradients(...)`."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 30.0,
                 retries: int | None = None, retry_for_s: float = 20.0, backoff_s: float = 0.25,
                 wire_format: str = "msgpack",
                 headers: dict[str, str] | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 ref_min_bytes: int | None = MIN_BYTES) -> None:
        super().__init__(base_url, api_key, timeout=timeout, retries=retries, retry_for_s=retry_for_s,
                         backoff_s=backoff_s, ref_min_bytes=ref_min_bytes,
                         wire_format=wire_format, headers=headers)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, transport=transport)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        self._buffer = bytearray()

    async def _send(self, method: str, path: str, **kw: Any) -> tuple[httpx.Response, bytearray | memoryview]:
        with self._encoded(kw, _AsyncPieces) as kw:
            return await self._send_encoded(method, path, **kw)

    async def _send_encoded(self, method: str, path: str, **kw: Any) -> tuple[httpx.Response, bytearray | memoryview]:
        attempt, started = 0, time.monotonic()
        replayable = self._replayable(method, path, kw)
        while True:
            try:
                response = await self._http.send(self._request(method, path, **kw, **self._age(attempt, started)),
                                                 stream=True)
                try:
                    body = _Body(response)
                    async for chunk in response.aiter_bytes():
                        body.add(chunk)
                finally:
                    await response.aclose()
            except httpx.TransportError as exc:
                delay = self._delay(attempt)
                if not self._may_retry(exc, attempt, replayable, started, delay):
                    raise self._connection_failed(method, path, exc, attempt + 1, started) from exc
                await anyio.sleep(delay)
                attempt += 1
                continue
            delay = self._delay(attempt, response) if response.status_code == 503 else 0.0
            if self._may_retry_503(response, body, attempt, replayable, started, delay):
                await anyio.sleep(delay)
                attempt += 1
                continue
            if response.status_code >= 400:
                raise self._error(response, body.done())
            return response, body.done()

    async def gradients(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                        losses: list | None = None, dtype: str | None = None, seed: int | None = None, wait_s: float = 30.0,
                        timeout: float | None = None, progress: bool = False, **options: Any) -> GradientResult:
        """Client.gradients, awaited."""
        deadline = _Deadline(timeout)  # the whole call's: the export, the server-side wait and the polling
        seed = _call_seed(model) if seed is None else seed  # drawn once: a resend repeats it
        args = (model, inputs, targets, loss, losses, dtype, seed, options)
        return await self._resending(args, lambda prepared: self._gradients(prepared, wait_s, deadline, progress))

    async def _resending(self, args: tuple, call: Callable[[_Prepared], Any]) -> Any:
        """Client._resending, awaited."""
        prepared = self._prepare(*args)
        await self._upload(prepared)
        try:
            return await call(prepared)
        except (GraphNotFoundError, TensorNotFoundError) as exc:
            if not self._lost(prepared, exc):
                raise
            prepared = self._prepare(*args)
            await self._upload(prepared)
            return await call(prepared)

    async def _upload(self, prepared: _Prepared) -> None:
        for ref, data in prepared.uploads:
            if ref not in self._refs.uploaded:
                await self._send("PUT", f"/tensors/{ref}", content=_AsyncPieces(data))
                self._refs.uploaded.add(ref)
                prepared.sent_bytes += len(data)

    async def _gradients(self, prepared: _Prepared, wait_s: float, deadline: _Deadline,
                         progress: bool) -> GradientResult:
        wait = deadline.wait(wait_s)
        try:
            answer = self._answer(prepared, *await self._send("POST", "/gradients", content=prepared,
                                                              params={"wait": wait}, extra_s=wait,
                                                              idempotency_key=_new_key()))
        except GradientClientError as exc:
            answer = self._job_to_wait_on(exc)
        if isinstance(answer, str):
            answer = await AsyncJob(self, answer, prepared.local_names).result(timeout=deadline.left(),
                                                                                progress=progress)
        return self._finished(prepared, answer)

    async def submit(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                     losses: list | None = None, dtype: str | None = None, seed: int | None = None,
                     **options: Any) -> "AsyncJob":
        """Client.submit, awaited."""
        seed = _call_seed(model) if seed is None else seed  # drawn once: a resend repeats it
        args = (model, inputs, targets, loss, losses, dtype, seed, options)
        async def post(p: _Prepared):  # one POST per body, each under its own key: a refused one made no job
            return p, await self._send("POST", "/gradients", content=p, params={"wait": 0}, idempotency_key=_new_key())

        prepared, (response, buf) = await self._resending(args, post)
        if response.status_code == 200:
            raw = self._decode(wire.GradientResult, response, buf)
            self._remember(prepared, raw.graph_ref)
            return AsyncJob(self, raw.job_id, prepared.local_names, done=build_result(raw, prepared.local_names))
        return AsyncJob(self, self._decode(wire.JobAccepted, response, buf).job_id, prepared.local_names,
                        prepared=prepared)

    def job(self, job_id: str) -> "AsyncJob":
        return AsyncJob(self, job_id)

    async def estimate(self, model: Any, inputs: Any, targets: Any = None, loss: Any = "cross_entropy", *,
                       losses: list | None = None, dtype: str | None = None, seed: int = 0,
                       **options: Any) -> wire.Estimate:
        args = (model, inputs, targets, loss, losses, dtype, seed, options)
        response, buf = await self._resending(args, lambda p: self._send("POST", "/estimate", content=p))
        return self._decode(wire.Estimate, response, buf)

    async def layers(self) -> list[wire.LayerInfo]:
        response, buf = await self._send("GET", "/layers")
        return self._decode(list[wire.LayerInfo], response, buf)

    async def health(self, ready: bool = False) -> dict[str, Any]:
        response, buf = await self._send("GET", "/readyz" if ready else "/healthz")
        return self._decode(dict[str, Any], response, buf)


class AsyncJob:
    """Job's methods as coroutines."""

    def __init__(self, client: AsyncClient, job_id: str, local_names: dict[str, str] | None = None, *,
                 done: GradientResult | None = None, prepared: _Prepared | None = None) -> None:
        self.client = client
        self.job_id = job_id
        self.local_names = local_names or {}
        self._done = done
        self._prepared = prepared  # a graph model's request: its answer's graph_ref goes to the export cache

    @property
    def id(self) -> str:
        """An alias of `job_id` (the name the wire and the errors use), kept for code written against `id`."""
        return self.job_id

    def __repr__(self) -> str:
        return f"AsyncJob({self.job_id!r})"

    async def info(self) -> Any:
        response, buf = await self.client._send("GET", f"/jobs/{self.job_id}")
        return self.client._decode(wire.JobInfo, response, buf)

    async def status(self) -> str:
        return (await self.info()).status

    async def cancel(self) -> str:
        response, buf = await self.client._send("DELETE", f"/jobs/{self.job_id}")
        return self.client._decode(wire.JobInfo, response, buf).status

    async def result(self, timeout: float | None = None, progress: bool = False) -> GradientResult:
        if self._done is not None:
            return self._done
        poll, bar = _Poll(timeout), _Progress(progress, self.job_id)
        try:
            while True:
                info = await self.info()
                bar.update(info)
                result = _outcome(self.client, info, self.local_names)
                if result is not None:
                    self._done = result
                    if self._prepared is not None:
                        self.client._remember(self._prepared, result.graph_ref)
                    return result
                await anyio.sleep(poll.next(self.job_id))
        finally:
            bar.close()


__all__ = ["AsyncClient", "AsyncJob", "Client", "Job"]
