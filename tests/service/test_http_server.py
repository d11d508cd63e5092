"""service/http_server.py under a real uvicorn on a socket: request heads bounded in bytes and lines (431 as the
bytes arrive), readers that stop reading cut after the write timeout, everything else served as before."""

from __future__ import annotations

import inspect
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gradsvc.runtime.launcher import free_port, wait_port
from service import http_server

LARGE = 32 << 20


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = b"x" * LARGE if scope["path"] == "/large" else b"got %d" % len(body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def server() -> str:
    limits = SimpleNamespace(max_header_bytes=8192, max_headers=20, write_timeout_s=1.0)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=http_server.protocol(limits), log_level="error",
                            lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_port(port)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def test_a_head_over_the_byte_limit_is_answered_431_and_closed_before_it_ends(server):
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000)  # the header has not ended
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert b'"code": "headers_too_large"' in answer and b"GRADSVC_MAX_HEADER_BYTES" in answer


def test_more_header_lines_than_the_limit_is_431(server):
    r = httpx.get(server + "/", headers={f"x-h{i}": "v" for i in range(30)})
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
    assert r.json()["error"]["detail"] == {"limit": 20, "setting": "GRADSVC_MAX_HEADERS"}


def test_bodies_larger_than_the_head_limit_and_keep_alive_requests_are_served(server):
    with httpx.Client(base_url=server) as client:
        for _ in range(3):  # one connection: each request's head is counted afresh
            r = client.post("/", content=b"b" * 300_000, headers={"x-some": "a" * 4000})
            assert r.status_code == 200 and r.text == "got 300000"


def test_a_reader_that_stops_reading_is_cut_after_the_write_timeout(server):
    port = int(server.rsplit(":", 1)[1])
    before = http_server.CLOSED["stalled_reader"]
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /large HTTP/1.1\r\nhost: x\r\n\r\n")
    time.sleep(3.0)  # reads nothing: past the 1 s write timeout
    got = 0
    try:
        while chunk := s.recv(1 << 20):
            got += len(chunk)
    except ConnectionResetError:
        pass
    finally:
        s.close()
    assert got < LARGE  # the rest was dropped with the connection
    assert http_server.CLOSED["stalled_reader"] == before + 1


def test_a_reader_that_reads_a_little_then_stops_is_cut_a_write_timeout_after_its_last_read(server):
    """httpx reads an answer's head and its first piece before its caller reads on; a caller that then stops
    reading is cut one write timeout (1 s here) after that read, not after two windows of the watch."""
    port = int(server.rsplit(":", 1)[1])
    before = http_server.CLOSED["stalled_reader"]
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    started = time.monotonic()
    s.sendall(b"GET /large HTTP/1.1\r\nhost: x\r\n\r\n")
    time.sleep(0.2)
    got = 0
    while got < 4 << 20:  # the head and a first few megabytes, then nothing
        got += len(s.recv(1 << 20))
    deadline = started + 1.85  # cut by ~1.5 s (the last read + 1 s + the watch's granularity); before: 2 s
    while http_server.CLOSED["stalled_reader"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    cut = http_server.CLOSED["stalled_reader"] == before + 1
    s.close()
    assert cut


def test_a_slow_reader_that_keeps_reading_gets_the_whole_answer(server):
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /large HTTP/1.1\r\nhost: x\r\n\r\n")
        got, started = 0, time.monotonic()
        while got < LARGE + 30:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
            time.sleep(0.05)
    assert got >= LARGE and time.monotonic() - started > 1.0  # longer than the write timeout, never cut


def test_the_uvicorn_methods_overridden_are_there_with_their_parameters():
    expected = {"connection_made": ["self", "transport"], "data_received": ["self", "data"],
                "on_message_complete": ["self"], "pause_writing": ["self"], "connection_lost": ["self", "exc"]}
    for name, params in expected.items():
        assert list(inspect.signature(getattr(HttpToolsProtocol, name)).parameters) == params, name
    assert "transport" in inspect.getsource(HttpToolsProtocol.connection_made)


def test_bodies_past_the_budget_are_refused_server_busy_while_another_is_held():
    import asyncio

    from service.exceptions import ServiceError

    budget = http_server.BodyBudget(limit_bytes=1000)
    release = asyncio.Event()
    outcomes: list[str] = []

    async def handler(scope, receive, send):
        try:
            await receive()
        except ServiceError as exc:
            outcomes.append(exc.code)
            return
        outcomes.append("read")
        if scope["path"] == "/hold":
            await release.wait()

    def request(path: str, size: int, chunked: bool = False):
        headers = [] if chunked else [(b"content-length", str(size).encode())]
        scope = {"type": "http", "path": path, "headers": headers}

        async def receive():
            return {"type": "http.request", "body": b"x" * size, "more_body": False}

        return budget.middleware(handler)(scope, receive, None)

    async def scenario():
        held = asyncio.ensure_future(request("/hold", 800))
        await asyncio.sleep(0.01)
        assert budget.held_bytes == 800
        await request("/", 300)  # 1100 > 1000: refused
        await request("/", 300, chunked=True)  # counted as it arrives: refused too
        await request("/", 150)  # 950: taken
        release.set()
        await held
        assert budget.held_bytes == 0
        await request("/", 5000)  # alone, a body over the budget is still taken

    asyncio.run(scenario())
    assert outcomes == ["read", "server_busy", "server_busy", "read", "read"]
