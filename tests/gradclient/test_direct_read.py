"""A large answer read from the socket straight into its buffer (gradclient/transfer.py, _Body.read_direct),
over real loopback HTTP from a server that sends what the test tells it: the bytes that came with the
headers and the rest end up in place, the next request opens a new connection, and an early close or a
stalled answer is httpx's own transport error (which the client's retry policy handles)."""

from __future__ import annotations

import socket
import threading

import httpx
import numpy as np
import pytest

from gradclient import Client
from gradclient.transfer import _DIRECT_MIN, AnswerBuffers, _Body

SIZE = _DIRECT_MIN + 123_457


def _payload(size: int = SIZE) -> bytes:
    return np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()


class _Server:
    """Answers each request on each connection with `plan(n)`: a list of byte strings sent one by one (n counts
    the requests served), then, if the plan says so, closes the connection or stalls."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.served = 0
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            while True:
                line = f.readline()
                if not line:
                    return
                while f.readline() not in (b"\r\n", b""):
                    pass
                parts, then = self.plan(self.served)
                self.served += 1
                for part in parts:
                    conn.sendall(part)
                if then == "close":
                    return
                if then == "stall":
                    self.stop.wait(10)
                    return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _head(length: int) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: {length}\r\n\r\n".encode()


@pytest.fixture
def payload() -> bytes:
    return _payload()


def test_a_large_answer_goes_from_the_socket_into_its_buffer_with_what_came_with_the_headers(payload):
    # The first send carries the headers and 1000 body bytes: h11 holds those when the headers are parsed.
    server = _Server(lambda n: ([_head(SIZE) + payload[:1000], payload[1000:]], "keep"))
    try:
        with httpx.Client() as http:
            for _ in range(2):
                response = http.send(http.build_request("GET", server.url), stream=True)
                body = _Body(response, AnswerBuffers())
                try:
                    assert body.read_direct(response)
                finally:
                    response.close()
                assert bytes(body.done()) == payload
        # h11 never saw the body, so httpcore closed the connection: the second answer came on a new one.
        assert server.connections == 2
    finally:
        server.close()


def test_the_client_reads_large_answers_directly_and_small_ones_through_httpx(payload):
    small = payload[:1000]
    server = _Server(lambda n: ([_head(SIZE), payload] if n % 2 == 0 else [_head(len(small)), small], "keep"))
    try:
        with Client(server.url, retry_for_s=0) as client:
            for want in (payload, small, payload, small):
                response, body = client._attempt(client._http.build_request("GET", server.url + "/x"))
                assert response.status_code == 200 and bytes(body.done()) == want
        assert server.connections == 3  # each large answer closes its connection, a small one keeps it
    finally:
        server.close()


def test_an_answer_cut_short_is_a_transport_error_the_retry_policy_sees(payload):
    server = _Server(lambda n: ([_head(SIZE), payload[:SIZE // 2]], "close"))
    try:
        with Client(server.url, retry_for_s=0) as client:
            outcome = client._attempt(client._http.build_request("GET", server.url))
        assert isinstance(outcome, httpx.RemoteProtocolError)
        assert f"expected {SIZE}" in str(outcome)
    finally:
        server.close()


def test_a_stalled_answer_times_out_as_a_read_timeout(payload):
    server = _Server(lambda n: ([_head(SIZE), payload[:SIZE // 2]], "stall"))
    try:
        with httpx.Client(timeout=httpx.Timeout(0.5)) as http:
            response = http.send(http.build_request("GET", server.url), stream=True)
            body = _Body(response, AnswerBuffers())
            try:
                with pytest.raises(httpx.ReadTimeout):
                    body.read_direct(response)
            finally:
                response.close()
    finally:
        server.close()


def test_a_small_answer_is_left_to_httpx(payload):
    server = _Server(lambda n: ([_head(1000), payload[:1000]], "keep"))
    try:
        with httpx.Client() as http:
            response = http.send(http.build_request("GET", server.url), stream=True)
            body = _Body(response, AnswerBuffers())
            assert not body.read_direct(response)  # below _DIRECT_MIN
            body.add(response.read())
            response.close()
            assert bytes(body.done()) == payload[:1000]
    finally:
        server.close()
