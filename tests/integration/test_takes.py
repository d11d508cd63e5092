"""A worker that takes several jobs at once (GRADSVC_WORKER_TAKE), on a live stack (a private redis-server, the API
over HTTP, real RQ workers): killed with SIGKILL while it holds a take, every job still ends exactly once (its running
job worker_lost, the taken ones queued again and finished by another worker, none started twice; one canceled while taken never starts)."""

from __future__ import annotations

import re
import signal
import time
from collections import Counter

import pytest

from gradsvc.broker import keys
from tests.integration.test_reliability import TERMINAL, long_body, small_body, submit
from tests.support.stack import start_stack, wait_status

_STARTED = re.compile(r"Worker gradsvc-\S+: \S+: .*\(([0-9a-f-]{36})\)\s*$")
SMALL = 12


@pytest.fixture()
def take_stack():
    s = start_stack(workers=1, GRADSVC_WORKER_TAKE="8", GRADSVC_WORKER_HEARTBEAT_S="1", GRADSVC_LOG_LEVEL="info")
    s.wait_ready(1)
    yield s
    s.stop()


def _starts(s) -> Counter:
    starts: Counter = Counter()
    for log in s.logdir.glob("worker-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = _STARTED.search(line)
            if m and "Job OK" not in line:
                starts[m.group(1)] += 1
    return starts


def test_a_worker_killed_holding_a_take_loses_none_and_runs_none_twice(take_stack):
    s = take_stack
    worker = s.workers[0]
    with s.http_client(timeout=60) as http, s.redis_client() as r:
        worker.send_signal(signal.SIGSTOP)  # its BLPOP is answered with the first job; the rest wait queued
        try:
            blocker = submit(http, long_body())  # minutes of work: the take stays held while it runs
            small = [submit(http, small_body()) for _ in range(SMALL)]
        finally:
            worker.send_signal(signal.SIGCONT)
        taken_key = keys.taken_key("gradsvc", _worker_name(r))
        deadline = time.monotonic() + 60
        while r.llen(taken_key) < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.llen(taken_key) == 7, f"the worker did not take 7 jobs; logs in {s.logdir}"
        assert wait_status(http, blocker, ("started",))["status"] == "started"
        assert [http.get(f"/jobs/{j}").json()["status"] for j in small[:7]] == ["queued"] * 7  # taken: still queued
        assert http.post(f"/jobs/{small[0]}/cancel").json()["status"] == "canceled"  # canceled while taken
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        s.start_worker()
        ended = {j: wait_status(http, j, TERMINAL, 90) for j in [blocker, *small]}
    assert ended[blocker]["status"] == "failed" and ended[blocker]["error"]["code"] == "worker_lost"
    assert [ended[j]["status"] for j in small] == ["canceled"] + ["finished"] * (SMALL - 1), \
        {j: ended[j]["status"] for j in small}
    starts = _starts(s)
    assert starts[small[0]] == 0 and all(starts[j] == 1 for j in small[1:]), starts
    assert starts[blocker] == 1


def _worker_name(r) -> str:
    names = [k.decode().removeprefix("rq:worker:") for k in r.keys("rq:worker:*") if b"." not in k[10:11]]
    names = [n for n in names if n.startswith("gradsvc-") and ":" not in n]  # not RQ's `<worker>:executions`
    assert len(names) == 1, names
    return names[0]
