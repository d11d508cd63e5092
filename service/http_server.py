"""The API's HTTP connections: uvicorn's httptools protocol with the limits it lacks, before any key is checked.

- A request's head (request line and headers) is bounded in bytes and in header lines
  (GRADSVC_MAX_HEADER_BYTES, GRADSVC_MAX_HEADERS): past either the connection is answered 431 and closed, as
  its bytes arrive, before the parser (which keeps a header whole in memory until it ends) holds them.
- Request bodies held at once are bounded in bytes (GRADSVC_MAX_BODIES_BYTES; a JSON body costs about 4x its
  size while it is decoded): past it a body is refused 503 server_busy before it is read (BodyBudget).
- A reader that stops reading its answer is cut: when the bytes waiting to be sent to a connection have not
  gone down for GRADSVC_WRITE_TIMEOUT_S, the connection is aborted, its buffer (a whole result) dropped.

uvicorn internals overridden (uvicorn 0.55, httptools_impl.HttpToolsProtocol; tests/service/test_http_server.py
pins them): data_received (the head is counted before the parser sees it), on_message_complete (the next
request's head starts), pause_writing (a buffer past the high-water mark starts the stall watch),
connection_lost (the watch ends). `serve` (what `gradsvc serve` runs) passes the class to uvicorn.run(http=...).
"""

from __future__ import annotations

import asyncio
import json
import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .exceptions import ServiceError

log = logging.getLogger("gradsvc.api")

# What the connections refused or cut, by reason: read by /metrics (service/api_metrics.py), per process.
CLOSED: dict[str, int] = {"headers_too_large": 0, "stalled_reader": 0}


def _refusal(message: str, detail: dict) -> bytes:
    body = json.dumps({"error": {"code": "headers_too_large", "message": message, "detail": detail}}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


class BoundedProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with bounded request heads and a write timeout; limits set by `protocol(settings)`."""

    max_header_bytes = 65536
    max_headers = 100
    write_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head: bytearray | None = bytearray()  # this request's head so far; None once it ended
        self._stall: asyncio.TimerHandle | None = None
        self._progress = (0, 0.0)  # (bytes waiting, when they last went down) while the stall watch runs

    def data_received(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            start = max(len(head) - 3, 0)
            head += data
            end = head.find(b"\r\n\r\n", start)
            size = len(head) if end < 0 else end + 4
            if size > self.max_header_bytes:
                return self._refuse(f"the request's headers are over {self.max_header_bytes} bytes "
                                    "(GRADSVC_MAX_HEADER_BYTES); send fewer or shorter headers",
                                    {"limit_bytes": self.max_header_bytes, "setting": "GRADSVC_MAX_HEADER_BYTES"})
            if end >= 0:
                lines = head.count(b"\r\n", 0, end)  # the request line's end and one per header but the last
                if lines > self.max_headers:
                    return self._refuse(f"the request has {lines} header lines, over the limit of {self.max_headers} "
                                        "(GRADSVC_MAX_HEADERS); send fewer headers",
                                        {"limit": self.max_headers, "setting": "GRADSVC_MAX_HEADERS"})
                self._head = None
        super().data_received(data)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head = bytearray()

    def _refuse(self, message: str, detail: dict) -> None:
        CLOSED["headers_too_large"] += 1
        log.warning("431 to %s: %s", self.client, message)
        self._head = None
        self.transport.write(_refusal(message, detail))
        self.transport.close()

    # --- slow or stalled readers -------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._progress = (self.transport.get_write_buffer_size(), self.loop.time())
            self._watch()

    def _watch(self) -> None:
        # Sampled four times a timeout: a reader that took a few pieces and then stopped is cut one timeout after
        # its last read (judged once a timeout, a read early in the window bought it a second window).
        self._stall = self.loop.call_later(self.write_timeout_s / 4, self._check_progress)

    def _check_progress(self) -> None:
        self._stall = None
        waiting = self.transport.get_write_buffer_size()
        if waiting == 0:
            return
        now = self.loop.time()
        if waiting < self._progress[0]:  # slow but reading: watch on
            self._progress = (waiting, now)
        if now - self._progress[1] < self.write_timeout_s:
            self._watch()
            return
        CLOSED["stalled_reader"] += 1
        log.warning("closing the connection of %s: it read none of the %d bytes waiting for it in %.0f s "
                    "(GRADSVC_WRITE_TIMEOUT_S)", self.client, waiting, self.write_timeout_s)
        self.transport.abort()  # close() would wait for the buffer to drain, which a stalled reader never does

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().connection_lost(exc)


def serve(settings) -> None:
    """`gradsvc serve`: the API (service.app's factory) under uvicorn with this protocol, until stopped."""
    uvicorn.run("service.app:app_factory", factory=True, host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), access_log=False,
                timeout_keep_alive=settings.keep_alive_s, http=protocol(settings))


def protocol(settings) -> type[BoundedProtocol]:
    """The protocol class with this service's limits, for uvicorn.run(http=...)."""
    return type("GradsvcHttpProtocol", (BoundedProtocol,), {
        "max_header_bytes": settings.max_header_bytes, "max_headers": settings.max_headers,
        "write_timeout_s": settings.write_timeout_s})


class BodyBudget:
    """The bytes of request bodies the API holds at once: a body takes its Content-Length (or, sent chunked, its
    bytes as they arrive) when the handler first reads it, and gives it back when the request ends. A body that
    would take the total past the limit is refused 503 server_busy, unless it would be the only one."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def take(self, n: int) -> None:
        if self.held_bytes and self.held_bytes + n > self.limit_bytes:
            raise ServiceError("server_busy", f"the API is holding {self.held_bytes} bytes of request bodies and "
                               f"this one's {n} would take it past its limit of {self.limit_bytes} "
                               "(GRADSVC_MAX_BODIES_BYTES); retry after Retry-After, or send large tensors by "
                               "reference (PUT /tensors, as the SDK does) so that bodies stay small",
                               headers={"Retry-After": "2"}, held_bytes=self.held_bytes, body_bytes=n,
                               limit_bytes=self.limit_bytes)
        self.held_bytes += n

    def middleware(self, app):
        async def wrapped(scope, receive, send):
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            declared = _content_length(scope)
            taken = 0

            async def counted_receive():
                nonlocal taken
                if declared is not None and not taken and declared:
                    self.take(declared)
                    taken = declared
                message = await receive()
                if declared is None and message["type"] == "http.request" and message.get("body"):
                    self.take(len(message["body"]))
                    taken += len(message["body"])
                return message

            try:
                await app(scope, counted_receive, send)
            finally:
                self.held_bytes -= taken

        return wrapped


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return max(int(value), 0)
            except ValueError:
                return None
    return None
