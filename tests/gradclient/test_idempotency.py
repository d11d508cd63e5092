"""One job per SDK call: against a stub HTTP server, the SDK sends one Idempotency-Key per call, sends a POST
again only under it, and never sends again a job that failed (worker_lost, out_of_memory, timeout)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import pytest

from gradclient import AsyncClient, Client, errors

SPEC = {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}], "dtype": "float64"}
X, Y = [[0.1, 0.2]], [1]


class Stub:
    """A real HTTP server on a free port; `script` maps (method, path) to a list of answers, used in turn
    (the last one repeats). An answer is (status, error code | body dict) or "drop" (close the socket)."""

    def __init__(self, script: dict) -> None:
        self.script = script
        self.seen: list[tuple[str, str, str | None]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                path = self.path.split("?")[0]
                stub.seen.append((self.command, path, self.headers.get("idempotency-key")))
                answers = stub.script[(self.command, path.rsplit("/", 1)[0] if path.startswith("/jobs/") else path)]
                n = sum(1 for m, p, _ in stub.seen if (m, p) == (self.command, path))
                answer = answers[min(n, len(answers)) - 1]
                if answer == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                status, what = answer
                # A job's failure names its job; an outage before the enqueue names none, as the API's do.
                job_id = None if what in ("queue_unavailable", "not_ready") else "job-1"
                body = what if isinstance(what, dict) else {"error": {"code": what, "message": f"{what} (stub)",
                                                                      "detail": {}}, "job_id": job_id,
                                                            "status": "failed"}
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.send_header("retry-after", "0")
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def posts(self) -> list[str | None]:
        return [key for method, path, key in self.seen if (method, path) == ("POST", "/gradients")]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def stub_for():
    stubs = []

    def make(script: dict) -> Stub:
        stubs.append(Stub(script))
        return stubs[-1]

    yield make
    for s in stubs:
        s.close()


def client(stub: Stub) -> Client:
    return Client(stub.url, retries=3, backoff_s=0.001, wire_format="json")


@pytest.mark.parametrize("status, code, cls", [(503, "worker_lost", errors.WorkerLostError),
                                               (507, "out_of_memory", errors.OutOfMemoryError),
                                               (504, "timeout", errors.JobTimeoutError)])
def test_a_job_that_failed_is_sent_once_and_raises_its_exception(stub_for, status, code, cls):
    stub = stub_for({("POST", "/gradients"): [(status, code)]})
    with client(stub) as c:
        with pytest.raises(cls) as info:
            c.gradients(SPEC, X, Y)
    assert len(stub.posts()) == 1 and stub.posts()[0]
    assert info.value.job_id == "job-1" and not info.value.is_retryable


def test_a_job_lost_after_the_202_is_not_sent_again(stub_for):
    failed = {"job_id": "job-1", "status": "failed", "progress": None, "result": None,
              "error": {"code": "worker_lost", "message": "lost (stub)", "detail": {}}}
    stub = stub_for({("POST", "/gradients"): [(202, {"job_id": "job-1", "status": "started"})],
                     ("GET", "/jobs"): [(200, failed)]})
    with client(stub) as c:
        with pytest.raises(errors.WorkerLostError):
            c.gradients(SPEC, X, Y)
    assert len(stub.posts()) == 1


def test_a_queue_outage_is_retried_under_one_key_per_call(stub_for):
    stub = stub_for({("POST", "/gradients"): [(503, "queue_unavailable")]})
    with client(stub) as c:
        for _ in range(2):
            with pytest.raises(errors.QueueUnavailableError):
                c.gradients(SPEC, X, Y)
    keys = stub.posts()
    assert len(keys) == 2 * 4  # each call: the first try and 3 retries
    assert len(set(keys[:4])) == 1 and len(set(keys[4:])) == 1 and keys[0] != keys[4] and None not in keys


def test_a_queue_outage_while_the_post_waited_on_its_job_resumes_on_that_job_without_a_second_post(stub_for):
    outage = {"error": {"code": "queue_unavailable", "message": "Redis stopped answering (stub)",
                        "detail": {"job_id": "job-7"}}}
    done = {"job_id": "job-7", "status": "failed", "progress": None, "result": None,
            "error": {"code": "timeout", "message": "ran too long (stub)", "detail": {}}}
    stub = stub_for({("POST", "/gradients"): [(503, outage)],
                     ("GET", "/jobs"): [(503, "queue_unavailable"), (200, done)]})
    with client(stub) as c:
        with pytest.raises(errors.JobTimeoutError) as info:
            c.gradients(SPEC, X, Y)
    assert len(stub.posts()) == 1 and info.value.job_id == "job-7"
    assert [p for m, p, _ in stub.seen if m == "GET"] == ["/jobs/job-7"] * 2  # the outage retried, then its end


def test_a_post_whose_answer_was_lost_is_sent_again_under_its_key(stub_for):
    stub = stub_for({("POST", "/gradients"): ["drop", (503, "worker_lost")]})
    with client(stub) as c:
        with pytest.raises(errors.WorkerLostError):
            c.submit(SPEC, X, Y)
    keys = stub.posts()
    assert len(keys) == 2 and keys[0] == keys[1] is not None


def test_the_async_client_sends_a_failed_job_once_too(stub_for):
    stub = stub_for({("POST", "/gradients"): [(503, "worker_lost")]})

    async def main() -> None:
        async with AsyncClient(stub.url, retries=3, backoff_s=0.001, wire_format="json") as c:
            with pytest.raises(errors.WorkerLostError):
                await c.gradients(SPEC, X, Y)

    anyio.run(main)
    assert len(stub.posts()) == 1 and stub.posts()[0]
