"""The SDK's request bodies: a large one is encoded into a buffer the client keeps and sent from it in
pieces, with a Content-Length. Against a real HTTP server that records what arrives: the bytes equal a
fresh encoding, every time (the buffer reused), after a dropped connection (the retry sends it again),
from threads sharing one Client, and from the AsyncClient."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import msgspec
import pytest
import torch

from gradclient import AsyncClient, Client
from gradclient.client import _KEPT_BUFFER_MIN
from gradclient.request import Call

SPEC = {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}], "dtype": "float32"}
ACCEPTED = msgspec.json.encode({"job_id": "job-1", "status": "queued"})


class Recorder:
    """Answers every POST /gradients 202; keeps each body with its framing headers. `drops` first POSTs
    are read whole and then answered by closing the socket."""

    def __init__(self, drops: int = 0) -> None:
        self.bodies: list[tuple[bytes, str | None, str | None]] = []
        self.drops = drops
        lock = threading.Lock()
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                length = self.headers.get("content-length")
                body = self.rfile.read(int(length)) if length else b""
                with lock:
                    rec.bodies.append((body, length, self.headers.get("transfer-encoding")))
                    drop = rec.drops > 0
                    rec.drops -= drop
                if drop:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.send_response(202)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(ACCEPTED)))
                self.end_headers()
                self.wfile.write(ACCEPTED)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def recorder():
    made = []

    def make(drops: int = 0) -> Recorder:
        made.append(Recorder(drops))
        return made[-1]

    yield make
    for r in made:
        r.close()


def batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, generator=g), torch.randint(0, 2, (rows,), generator=g)


def expected(client: Client | AsyncClient, x: torch.Tensor, y: torch.Tensor) -> bytes:
    return client._prepare(Call(SPEC, x, y, seed=0)).content


@pytest.mark.parametrize("wire_format", ["msgpack", "json"])
def test_large_bodies_arrive_whole_with_a_content_length_and_the_buffer_is_reused(recorder, wire_format):
    rec = recorder()
    with Client(rec.url, wire_format=wire_format) as client:
        sent = []
        for seed, rows in enumerate([300_000, 200_000, 300_000, 10]):  # large, smaller, larger again, small
            x, y = batch(rows, seed)
            client.submit(SPEC, x, y)
            sent.append(expected(client, x, y))
    assert len(sent[0]) > _KEPT_BUFFER_MIN > len(sent[3])
    assert [b for b, _, _ in rec.bodies] == sent
    assert all(length == str(len(b)) and te is None for b, length, te in rec.bodies)


def test_a_dropped_connection_sends_the_same_large_body_again(recorder):
    rec = recorder(drops=1)
    x, y = batch(300_000, 1)
    with Client(rec.url, retries=3, backoff_s=0.001) as client:
        assert client.submit(SPEC, x, y).id == "job-1"
        want = expected(client, x, y)
        x2, y2 = batch(250_000, 2)  # and the next request after the retry still has the buffer
        client.submit(SPEC, x2, y2)
        want2 = expected(client, x2, y2)
    assert [b for b, _, _ in rec.bodies] == [want, want, want2]


def test_threads_sharing_a_client_each_send_their_own_body(recorder):
    rec = recorder()
    batches = [batch(150_000 + 1000 * i, i) for i in range(8)]
    with Client(rec.url) as client:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda b: client.submit(SPEC, *b), batches))
        want = sorted(expected(client, *b) for b in batches)
    assert sorted(b for b, _, _ in rec.bodies) == want


def test_the_async_client_sends_large_bodies_whole_and_concurrently(recorder):
    rec = recorder(drops=1)
    batches = [batch(200_000 + 1000 * i, i) for i in range(4)]

    async def main() -> list[bytes]:
        async with AsyncClient(rec.url, retries=3, backoff_s=0.001) as client:
            async with anyio.create_task_group() as tg:
                for b in batches:
                    tg.start_soon(client.submit, SPEC, *b)
            return [expected(client, *b) for b in batches]

    want = anyio.run(main)
    got = [b for b, _, _ in rec.bodies]
    assert len(got) == 5 and sorted(set(got)) == sorted(want)  # the dropped one arrived again
    assert all(length == str(len(b)) and te is None for b, length, te in rec.bodies)


def test_a_large_answer_is_read_into_uninitialised_memory_and_a_short_or_long_one_still_reads_whole():
    import httpx

    from gradclient.client import _LARGE_ANSWER, _Body

    payload = bytes(range(256)) * ((_LARGE_ANSWER + 4096) // 256)
    for announced, chunks in [(len(payload), 70_000), (len(payload) + 10, 65_536), (len(payload) - 300, 65_536),
                              (100, 7)]:
        data = payload if announced > 100 else payload[:100]
        body = _Body(httpx.Response(200, headers={"content-length": str(announced)}))
        assert isinstance(body.buf, memoryview if announced >= _LARGE_ANSWER else bytearray)
        for i in range(0, len(data), chunks):
            body.add(data[i:i + chunks])
        got = body.done()
        assert bytes(got) == data and not getattr(got, "readonly", False)
    encoded = _Body(httpx.Response(200, headers={"content-length": str(len(payload)), "content-encoding": "gzip"}))
    assert isinstance(encoded.buf, bytearray)  # the decoded length is not the announced one



class TiedLM(torch.nn.Module):
    """An embedding whose table the head shares (GPT-2's tying: one Parameter, two names), a large buffer
    the forward updates in training mode, and a frozen projection: each 128 KiB or more."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)
        self.frozen = torch.nn.Linear(64, 512, bias=False).requires_grad_(False)
        self.head = torch.nn.Linear(64, 512, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("seen", torch.zeros(64 * 512))

    def forward(self, ids):
        h = self.embed(ids).mean(1)
        if self.training:
            with torch.no_grad():
                self.seen.add_(1.0)
        return self.head(h) + self.frozen(h)


def test_changing_weights_go_in_the_body_and_unchanged_ones_by_reference():
    """The SDK's choice per large tensor (gradclient/refs.py): a weight that trains goes in the body the
    first time and whenever it changed, a frozen one by reference from the first call, a buffer that
    changed in the body; sent again unchanged, each by reference."""
    from gradclient.request import RequestBuilder, _Inline
    from gradsvc import wire

    torch.manual_seed(0)
    model = TiedLM()
    builder = RequestBuilder("msgpack", msgspec.msgpack.Encoder(), ref_min_bytes=64 << 10)
    ids, y = torch.randint(0, 512, (4, 3)), torch.randint(0, 512, (4,))

    def sent() -> dict[str, str]:
        prep = builder.prepare(Call(model, ids, y, seed=0, options={"numcheck": "off"}))
        builder.refs.uploaded.update(d for d, _ in prep.uploads)  # as if the PUTs went through
        return {n: "ref" if isinstance(w, wire.Tensor) and w.refs else "body"
                for n, w in prep.body["model"]["weights"].items()}

    # torch.export names the tied table once
    assert sent() == {"embed.weight": "body", "frozen.weight": "ref", "seen": "ref"}
    assert sent() == {"embed.weight": "ref", "frozen.weight": "ref", "seen": "ref"}
    model(ids)  # training mode: the buffer changes
    with torch.no_grad():
        model.embed.weight.add_(0.1)  # an optimizer step on the table
    assert sent() == {"embed.weight": "body", "frozen.weight": "ref", "seen": "body"}
    assert builder.refs.hashed_bytes == 3 * 64 * 512 * 4  # each hashed once, when first sent by reference

    # A tied weight under two names in one body (a layer spec names both): in the body under each, not by
    # reference under the second because the first look already recorded it.
    with torch.no_grad():
        model.embed.weight.add_(0.1)
    inline, uploads = _Inline(), []
    first, second = (builder._weight(model.embed.weight, uploads, inline) for _ in range(2))
    assert not first.refs and not second.refs and not uploads
