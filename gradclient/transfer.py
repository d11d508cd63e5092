"""The bytes of a request and of its answer: the request built (Send), its body encoded into a buffer the
client keeps and sent in pieces; the answer read into one buffer sized from its Content-Length, and decoded
(AnswerReader) into the wire's types, whose tensors are views into that buffer, or into the API's error."""

from __future__ import annotations

import contextlib
import socket
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import msgspec
import numpy as np

from gradsvc import wire

from .errors import GradientClientError, error_for
from .tensors import decode_type

MSGPACK = "application/msgpack"

# An answer at least this large is read into uninitialised memory from numpy, which asks Linux for huge
# pages: a 33.6 MB answer then takes ~530 page faults instead of ~8,200 and is not zeroed first (filling
# it 21 -> 4 ms on a 2-core VM).
_LARGE_ANSWER = 1 << 20

# A body at least this large is encoded into a buffer the client keeps from one request to the next and
# sent from it in pieces: encoding the 36 MB body of an 8 x 1024 MLP into fresh memory took 18-20 ms on a
# 2-core VM (its pages faulted in one by one; up to 95 ms while the kernel was short of free pages),
# into a buffer used before 2 ms. httpcore's h11 copies each piece into a bytes of its own, so a piece is
# 1 MiB (reused memory) rather than the whole body (another fresh 36 MB).
_KEPT_BUFFER_MIN = 1 << 20
_PIECE = 1 << 20

# An answer at least this large on a plain HTTP/1.1 connection is read from the socket straight into its
# buffer (read_direct): httpcore reads 64 KiB at a time and h11 copies each chunk four times on its way
# (into its receive buffer, out of it twice, into bytes), 17-23 ms for a 12.6 MB answer on a 2-core VM
# against 5 ms for recv_into alone.
_DIRECT_MIN = 4 << 20


class AnswerBuffers:
    """A client's large answers' buffers, reused once nothing holds a view of them any more: a training loop's
    gradients are views into the answer, dropped by the next step's zero_grad(), so the buffer of step k serves
    step k + 2 (the result of step k + 1 is still alive while step k + 2 runs). Fresh memory faults its pages
    in (12.6 MB: 1-3 ms, up to 20 ms when the VM must compact memory for huge pages); a buffer used before
    does not. Each answer gets a lease, a numpy view of a kept buffer that every view and tensor of the
    answer references (as their exporter); the buffer is free again once its lease is gone (a weak reference
    tells), with no reference counting of our own. At most KEEP buffers."""

    KEEP = 2

    def __init__(self) -> None:
        self.kept: list[list] = []  # [buffer, weak reference to its current lease or None]
        self.lock = threading.Lock()

    @staticmethod
    def _free(entry: list) -> bool:
        return entry[1] is None or entry[1]() is None

    def view(self, size: int) -> memoryview:
        """`size` bytes of a free kept buffer (not one more than twice as large), else of a new one, kept in
        place of the smallest free one when KEEP are kept."""
        with self.lock:
            free = [e for e in self.kept if self._free(e) and size <= e[0].nbytes <= 2 * size]
            if free:
                entry = min(free, key=lambda e: e[0].nbytes)
            else:
                entry = [np.empty(size, dtype=np.uint8), None]
                if len(self.kept) >= self.KEEP:
                    idle = [e for e in self.kept if self._free(e)]
                    if idle:
                        victim = min(idle, key=lambda e: e[0].nbytes)
                        self.kept = [e for e in self.kept if e is not victim]
                if len(self.kept) < self.KEEP:
                    self.kept.append(entry)
            lease = entry[0][:size]
            entry[1] = weakref.ref(lease)
            return memoryview(lease)

    def release(self) -> None:
        with self.lock:
            self.kept = []


class _Body:
    """The answer's bytes in one writable buffer, sized from Content-Length: tensors are views into it."""

    def __init__(self, response: httpx.Response, buffers: AnswerBuffers | None = None) -> None:
        length = response.headers.get("content-length")
        size = int(length) if length and length.isdigit() else 0
        self.buf: bytearray | memoryview
        if size >= _LARGE_ANSWER and "content-encoding" not in response.headers:
            self.buf = buffers.view(size) if buffers is not None else memoryview(np.empty(size, dtype=np.uint8))
        else:
            self.buf = bytearray(size)
        self.n = 0

    def add(self, chunk: bytes) -> None:
        end = self.n + len(chunk)
        if end > len(self.buf) and isinstance(self.buf, memoryview):  # longer than announced: grow as bytes
            self.buf = bytearray(self.buf[:self.n])
        self.buf[self.n:end] = chunk  # grows the buffer only when the length was unknown or encoded
        self.n = end

    def read_direct(self, response: httpx.Response) -> bool:
        """The whole body read from the connection's socket into the buffer, past httpcore and h11; False
        (nothing read) unless the answer is large, of known length, not encoded, and the connection is a
        plain HTTP/1.1 one whose state is as httpcore 1.x leaves it after the headers. h11 is left with the
        body unread, so httpcore closes the connection when the response is (the next request opens
        another). A socket error or timeout, or an early close, raises httpx's own exception."""
        if not isinstance(self.buf, memoryview) or len(self.buf) < _DIRECT_MIN or self.n:
            return False
        connection = _connection(response)
        try:
            h11_state, stream = connection._h11_state, connection._network_stream
            reader, buffered = h11_state._reader, h11_state._receive_buffer
            sock = stream.get_extra_info("socket")
        except AttributeError:
            return False
        if (type(stream).__name__ != "SyncStream" or not isinstance(sock, socket.socket)
                or type(reader).__name__ != "ContentLengthReader"
                or not (reader._length == reader._remaining == len(self.buf)) or len(buffered) > len(self.buf)):
            return False
        early = bytes(buffered)  # what came with the headers
        self.buf[:len(early)] = early
        self.n = len(early)
        timeout = response.request.extensions.get("timeout", {}).get("read")
        try:
            sock.settimeout(timeout)
            while self.n < len(self.buf):
                got = sock.recv_into(self.buf[self.n:])
                if not got:
                    raise httpx.RemoteProtocolError(f"peer closed connection without sending complete message body "
                                                    f"(received {self.n} bytes, expected {len(self.buf)})",
                                                    request=response.request)
                self.n += got
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=response.request) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc), request=response.request) from exc
        return True

    def done(self) -> bytearray | memoryview:
        if self.n < len(self.buf):
            if isinstance(self.buf, memoryview):
                self.buf = self.buf[:self.n]
            else:
                del self.buf[self.n:]
        return self.buf


def _connection(response: httpx.Response) -> Any:
    """The httpcore connection under a streamed response: httpx's BoundSyncStream and ResponseStream, then
    httpcore's PoolByteStream and HTTP11ConnectionByteStream, whose `_connection` it is (None if not found)."""
    obj = response.stream
    for _ in range(6):
        connection = getattr(obj, "_connection", None)
        if connection is not None:
            return connection
        obj = getattr(obj, "_httpcore_stream", None) or getattr(obj, "_stream", None)
    return None


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


class KeptBuffer:
    """The buffer a client encodes its large bodies into, one request at a time (see _KEPT_BUFFER_MIN)."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.buffer = bytearray()
        self.lock = threading.Lock()

    def release(self) -> None:
        """Drops the buffer (the client closed); the next body makes a new one."""
        self.buffer = bytearray()

    @contextlib.contextmanager
    def encoded(self, body: Any, pieces: type[_Pieces]) -> Iterator[tuple[bytes | _Pieces, int]]:
        """`body` encoded, and its length, for as long as the request (and its retries) runs: into the kept
        buffer when no other request of this client holds it, else into fresh bytes."""
        if not self.lock.acquire(blocking=False):
            content = self.encoder.encode(body)
            yield content, len(content)
            return
        view = None
        try:
            try:
                self.encoder.encode_into(body, self.buffer)
            except BufferError:  # a view of it outlived its request (a caller kept one): leave it to them
                self.buffer = bytearray()
                self.encoder.encode_into(body, self.buffer)
            if len(self.buffer) < _KEPT_BUFFER_MIN:
                yield bytes(self.buffer), len(self.buffer)
            else:
                view = memoryview(self.buffer)
                yield pieces(view), len(view)
        finally:
            if view is not None:
                try:
                    view.release()
                except BufferError:
                    self.buffer = bytearray()
            self.lock.release()


@dataclass(frozen=True)
class Send:
    """One HTTP request of a flow, as it is sent on each try (base.py's _sending)."""

    method: str
    path: str
    content: Any = None  # bytes or _Pieces (an Outgoing body once encoded)
    params: dict | None = None
    extra_s: float = 0.0  # the server-side wait (`?wait=`) the read timeout must cover
    idempotency_key: str | None = None
    release: list[str] | None = None  # results the service may drop (wire.RELEASE_HEADER)
    accept: str | None = None  # an Accept other than the client's (a session's weights as safetensors)

    def request(self, http: Any, timeout: float, key_age_s: float | None) -> httpx.Request:
        """The try's httpx.Request; `key_age_s` (a try again) goes with its Idempotency-Key."""
        limits = httpx.Timeout(timeout + self.extra_s, connect=min(timeout, 10.0))
        headers = {"Idempotency-Key": self.idempotency_key} if self.idempotency_key else {}
        if self.release:
            headers[wire.RELEASE_HEADER] = ", ".join(self.release)
        if self.accept:
            headers["Accept"] = self.accept
        if self.idempotency_key and key_age_s is not None:
            # A retry: the service refuses it (job_lost) if Redis lost its data since the first try, whose
            # job may have run, rather than run it a second time under a key it no longer knows.
            headers["Idempotency-Key-Age"] = f"{key_age_s:.3f}"
        if isinstance(self.content, _Pieces):  # a stream of known length: Content-Length, not chunked
            headers["Content-Length"] = str(len(self.content))
        return http.build_request(self.method, self.path, content=self.content, params=self.params,
                                  timeout=limits, headers=headers or None)


class AnswerReader:
    """An answer's body decoded, msgpack or JSON as its Content-Type says, with one msgspec decoder per type
    kept; an error answer as the exception class of its code (errors.py)."""

    def __init__(self) -> None:
        self.decoders: dict[tuple[Any, bool], Any] = {}

    def decode(self, tp: Any, response: httpx.Response, buf: bytearray | memoryview) -> Any:
        is_msgpack = response.headers.get("content-type", "").startswith(MSGPACK)
        decoder = self.decoders.get((tp, is_msgpack))
        if decoder is None:
            kind = msgspec.msgpack if is_msgpack else msgspec.json
            decoder = self.decoders[(tp, is_msgpack)] = kind.Decoder(decode_type(tp))
        try:
            return decoder.decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise GradientClientError(f"could not read the answer to {response.request.method} "
                                      f"{response.request.url.path}: {exc}", code="bad_response",
                                      response=response) from None

    def error_body(self, response: httpx.Response, buf: bytearray | memoryview) -> wire.ErrorBody | None:
        """The API's error body, or None for an answer that is not one (a proxy's)."""
        try:
            return self.decode(wire.ErrorBody, response, buf)
        except GradientClientError:
            return None

    def error(self, response: httpx.Response, buf: bytearray | memoryview) -> GradientClientError:
        """The exception an error answer raises, carrying the response (with its body: streamed responses
        keep none)."""
        response = httpx.Response(response.status_code, headers=response.headers, content=bytes(buf),
                                  request=response.request)
        body = self.error_body(response, bytearray(buf))
        if body is None:
            return GradientClientError(f"HTTP {response.status_code} from {response.request.url}: "
                                       f"{response.text[:300]}", code=f"http_{response.status_code}",
                                       response=response)
        detail = dict(body.error.detail)
        if body.job_id:
            detail.setdefault("job_id", body.job_id)
        return error_for(body.error.code, body.error.message, detail, response)


__all__ = ["AnswerReader", "KeptBuffer", "Send"]
