"""More than one host, simulated on this one: a live stack (Redis, the API, a worker; the handoff on,
GRADSVC_HANDOFF_DIR under the host's /dev/shm) plus a "second host": processes in their own mount namespace
with a private tmpfs on /dev/shm (the same GRADSVC_HANDOFF_DIR path, another domain) and, for its worker, their
own network namespace, reaching the API's Redis through a veth pair and a fault proxy this test controls.

- An API on the second host reading a result handed over as a file on the first answers 421 `result_elsewhere`
  (it answered 500 `internal_error`).
- With the second host's worker live, large jobs carry their bodies inline (the plain queue) and their results
  through Redis: no file is routed to a worker that cannot read it, and every answer equals local autograd.
- A partition between that worker and Redis mid-job ends with the job reported `worker_lost` once: the worker,
  back after the partition, drops the outcome of the job it was cut off from instead of writing it over the
  report (workers/worker.py `_reaped`), and serves the next job.

Skipped (with the reason) where mount or network namespaces cannot be made (not root, no CAP_SYS_ADMIN)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from rq.job import Job

from gradsvc.broker import handoff as hf
from gradsvc.broker import keys
from gradsvc.runtime.launcher import free_port, wait_port

from ..support.stack import ROOT, client_fixtures, start_stack, wait_started, wait_status
from .test_handoff import MIN_BYTES, assert_gradients, body, files_of, local_gradients, post
from .test_hard_deadline import TERMINAL, wedging_body
from .test_reliability import small_body

# Namespaces, a fault proxy and two stacks' worth of processes: ~40 s here, over the suite's budget with the
# rest; `make test-all` runs it (docs/testing.md).
pytestmark = pytest.mark.slow

# Mount a private tmpfs on /dev/shm, then run the command: the second host's view of the handoff dir.
PRIVATE_SHM = 'mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec "$0" "$@"'


def _can(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if r.returncode == 0 else (r.stderr.decode(errors="replace").strip() or f"exit {r.returncode}")


def _skip_without_namespaces() -> None:
    if sys.platform != "linux" or os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")):
        pytest.skip("simulating a second host needs Linux, root, unshare and ip (iproute2)")
    why = _can(["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"])
    if why:
        pytest.skip(f"mount namespaces are not permitted here: {why}")
    probe = f"gsvc-probe-{os.getpid()}"
    why = _can(["ip", "netns", "add", probe])
    if why:
        pytest.skip(f"network namespaces are not permitted here: {why}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


class FaultProxy:
    """A TCP proxy from (host, port) to 127.0.0.1:target that the test partitions: `partition()` blackholes
    every connection (bytes read are discarded, nothing is answered, none is closed: a silent network), and
    `heal()` closes those connections (their state is lost, as across a real partition) and forwards again."""

    def __init__(self, host: str, target: int) -> None:
        self.target = target
        self.server = socket.create_server((host, 0))
        self.port = self.server.getsockname()[1]
        self.passing = True
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.passing:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close(src, dst)

    def _close(self, *socks: socket.socket) -> None:
        for s in socks:
            with self.lock:
                self.conns.discard(s)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def partition(self) -> None:
        self.passing = False

    def heal(self) -> None:
        with self.lock:
            cut = list(self.conns)
        self._close(*cut)
        self.passing = True

    def close(self) -> None:
        self.server.close()
        self.heal()


class SecondHost:
    """A network namespace joined to this one by a veth pair: 10.<a>.<b>.1 here, .2 there."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.netns, self.veth = f"gsvc-{tag}", f"gsv{tag}"
        a, b = 200 + tag % 50, tag % 250
        self.here, self.there = f"10.{a}.{b}.1", f"10.{a}.{b}.2"
        for cmd in (f"netns add {self.netns}",
                    f"link add {self.veth}a type veth peer name {self.veth}b",
                    f"link set {self.veth}b netns {self.netns}",
                    f"addr add {self.here}/30 dev {self.veth}a", f"link set {self.veth}a up",
                    f"-n {self.netns} addr add {self.there}/30 dev {self.veth}b",
                    f"-n {self.netns} link set {self.veth}b up", f"-n {self.netns} link set lo up"):
            subprocess.run(["ip", *cmd.split()], check=True, capture_output=True)

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", f"{self.veth}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)


@pytest.fixture(scope="module")
def hosts():
    _skip_without_namespaces()
    stack = start_stack(workers=1, handoff=True, GRADSVC_HANDOFF_MIN_BYTES=str(MIN_BYTES),
                        GRADSVC_WORKER_HEARTBEAT_S="1")
    second = proxy = None
    try:
        second = SecondHost()
        proxy = FaultProxy(second.here, stack.redis.port)
        yield stack, second, proxy
    finally:
        stack.stop()
        if proxy is not None:
            proxy.close()
        if second is not None:
            second.remove()


@pytest.fixture(scope="module")
def first_host(hosts):
    return hosts[0]


http, redis = client_fixtures("first_host")


def _on_second_host(stack, name: str, args: list[str], netns: str | None = None, **env: str) -> subprocess.Popen:
    """`python -m gradsvc <args>` with a private /dev/shm (and in `netns`), logging to the stack's logdir."""
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM, sys.executable, "-m",
           "gradsvc", *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    log = open(stack.logdir / f"{name}.log", "ab")
    return subprocess.Popen(cmd, env={**stack.env, **env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_an_api_on_another_host_reading_a_handed_off_result_answers_421_result_elsewhere(http, redis, hosts):
    stack, _, _ = hosts
    r = post(http, body())
    assert r.status_code == 200, r.content[:300]
    job_id = msgspec.msgpack.decode(r.content)["job_id"]
    assert redis.get(keys.result_key("gradsvc", job_id)).startswith(hf.MARKER)  # a file on this host
    port = free_port()
    api = _on_second_host(stack, "api-second-host", ["serve"], GRADSVC_PORT=str(port))
    try:
        wait_port(port, 30)
        with type(http)(base_url=f"http://127.0.0.1:{port}", timeout=60) as other:
            r = other.get(f"/jobs/{job_id}")
            assert r.status_code == 421, r.text
            assert r.json()["error"]["code"] == "result_elsewhere" and r.json()["error"]["detail"]["job_id"] == job_id
            assert other.post("/gradients?wait=60", json=small_body()).status_code == 200  # it serves the rest
    finally:
        _stop(api)
    assert http.get(f"/jobs/{job_id}").json()["status"] == "finished"  # this host's API still reads it


@pytest.fixture(scope="module")
def second_worker(hosts):
    stack, second, proxy = hosts
    proc = _on_second_host(stack, "worker-second-host", ["worker", "--index", "7"], netns=second.netns,
                           GRADSVC_REDIS_URL=f"redis://{second.here}:{proxy.port}/0")
    try:
        stack.wait_ready(2)
        time.sleep(1.2)  # the API's look at the workers' queues is cached a second
        yield proc
    finally:
        if proc.poll() is None:
            _stop(proc)


def _ran_on(redis, job_id: str) -> int:
    return int(redis.hget(Job.key_for(job_id), "worker_name").decode().split("-")[-2])


def test_with_a_worker_on_another_host_large_jobs_go_inline_and_every_answer_comes_back(http, redis, hosts,
                                                                                       second_worker):
    stack, _, _ = hosts
    want = local_gradients()

    def one(_):
        with stack.http_client() as client:
            return post(client, body())

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(one, range(6)))
    ids = []
    for r in answers:
        assert r.status_code == 200, r.content[:300]
        answer = msgspec.msgpack.decode(r.content)
        assert_gradients(answer, want)
        job_id = answer["job_id"]
        ids.append(job_id)
        assert redis.hget(Job.key_for(job_id), "origin") == b"gradsvc"  # the plain queue: any host's worker
        assert len(redis.hget(Job.key_for(job_id), "data")) > MIN_BYTES  # the body inline, not a ref
        assert not redis.get(keys.result_key("gradsvc", job_id)).startswith(hf.MARKER)
    assert files_of(stack.handoff_dir, ids) == []
    ran = {_ran_on(redis, j) for j in ids}
    print(f"6 large jobs ran on workers {sorted(ran)} (second host: {second_worker.pid})")
    assert second_worker.pid in ran, (ran, stack.logs()[-3000:])


def test_a_partition_between_a_worker_and_redis_mid_job_reports_the_job_once(http, redis, hosts, second_worker):
    """Last: the first host's worker is stopped, so the second host's takes the job."""
    stack, _, proxy = hosts
    for proc in stack.workers:
        _stop(proc)
    stack.workers = []
    r = http.post("/gradients?wait=0", json=wedging_body(40_000))  # 6.4e9 elements summed: seconds in one op
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    assert wait_started(redis, [job_id], 1) == [job_id] and _ran_on(redis, job_id) == second_worker.pid
    proxy.partition()
    try:
        job = wait_status(http, job_id, TERMINAL, 30)  # the API reaps the lapsed lease when the job is read
        print(f"partitioned job: {job['status']} {job.get('error') and job['error']['code']}")
        assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", job
    finally:
        proxy.heal()
    # The worker comes back, ends the job it was cut off from (dropping its outcome) and serves the next.
    r = http.post("/gradients?wait=120", json=small_body())
    assert r.status_code == 200, (r.text, stack.logs()[-3000:])
    assert _ran_on(redis, r.json()["job_id"]) == second_worker.pid
    job = http.get(f"/jobs/{job_id}").json()
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", job  # reported once
    assert redis.get(keys.result_key("gradsvc", job_id)) is None
    assert "its outcome is dropped" in (stack.logdir / "worker-second-host.log").read_text()
