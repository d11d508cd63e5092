"""A real stack for tests: a private redis-server, the API (uvicorn) and workers as subprocesses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gradsvc.runtime.launcher import claim_handoff_dir, free_port, handoff_dir, redis_server_binary, wait_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen | None = None
    args: tuple[str, ...] = ()  # extra redis-server arguments, e.g. ("--appendonly", "yes", "--dir", d)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--loglevel", "warning", *self.args], stdout=subprocess.DEVNULL)
        wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@dataclass
class Stack:
    redis: RedisServer
    env: dict[str, str]
    api_port: int
    metrics_port: int
    api: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)
    logdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gradsvc-test-")))
    handoff_dir: Path | None = None  # made for this stack (start_stack(handoff=True)), removed at stop
    python: str = sys.executable  # the interpreter the API and workers run on (bench/zoo.py: the server's venv)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def http_client(self, timeout: float = 120) -> httpx.Client:
        """An httpx client on this stack's API with its first API key, if it has keys (close it, or use it
        as a context manager)."""
        return httpx.Client(base_url=self.base_url, timeout=timeout, headers=self.auth_headers())

    def sdk_client(self, timeout: float = 300, **kwargs):
        """The SDK's Client on this stack's API with its first API key (close it, or use it as a context
        manager); kwargs as Client takes them (a transport, retries)."""
        from gradclient import Client

        return Client(self.base_url, api_key=self.api_key, timeout=timeout, **kwargs)

    def redis_client(self):
        """A redis-py client on this stack's Redis (close it)."""
        import redis

        return redis.Redis.from_url(self.redis.url)

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "ab")
        return subprocess.Popen([self.python, "-m", "gradsvc", *args], env=self.env, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)

    def start_api(self, wait: bool = True) -> None:
        """Starts the API; `wait`: returns once it listens (else the caller waits for self.api_port)."""
        self.api = self._spawn("api", "serve")
        if wait:
            wait_port(self.api_port, 120)  # on a loaded 2-core machine importing the app alone can take 30 s

    def start_worker(self, index: int | None = None) -> subprocess.Popen:
        index = len(self.workers) if index is None else index
        proc = self._spawn(f"worker-{index}", "worker", "--index", str(index))
        self.workers.append(proc)
        return proc

    def wait_ready(self, workers: int = 1, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.base_url}/readyz", timeout=2, headers=self.auth_headers())
                if r.status_code == 200 and r.json()["workers"] >= workers:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"stack not ready after {timeout_s} s; logs in {self.logdir}")

    @property
    def api_key(self) -> str | None:
        """The first of GRADSVC_API_KEYS (the stack's own or the environment's), None without keys."""
        return self.env.get("GRADSVC_API_KEYS", "").split(",")[0] or None

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.logdir.glob("*.log"))

    def stop(self) -> None:
        procs = [p for p in [self.api, *self.workers] if p is not None and p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.redis.stop()
        if self.handoff_dir is not None:
            shutil.rmtree(self.handoff_dir, ignore_errors=True)


def dead_redis_url() -> str:
    """A Redis URL nothing listens on: for an API built in this process whose test needs no Redis."""
    return f"redis://127.0.0.1:{free_port()}/0"


def _free_port_run(n: int, avoid: set[int]) -> int:
    """A port p with p .. p+n-1 all free: worker i serves its metrics on GRADSVC_WORKER_METRICS_PORT + i."""
    import socket

    while True:
        base = free_port()
        ports = range(base, base + n)
        if avoid.intersection(ports):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base


def start_stack(workers: int = 1, redis_args: tuple[str, ...] = (), handoff: bool = False,
                redis: RedisServer | None = None, python: str = sys.executable, **env_overrides: str) -> Stack:
    """`handoff=True`: the stack as `gradsvc up` configures it, large payloads handed over in a per-stack
    dir under /dev/shm (gradsvc/broker/handoff.py). Else GRADSVC_HANDOFF_DIR as the environment gives it (the
    tests: off). `redis`: one the caller started (a Sentinel-monitored master), else a private one."""
    redis = redis or RedisServer(free_port(), args=redis_args).start()
    api_port = free_port()
    metrics_port = _free_port_run(4, avoid={api_port, redis.port})
    env = {**os.environ, "GRADSVC_REDIS_URL": redis.url, "GRADSVC_PORT": str(api_port),
           "GRADSVC_WORKER_METRICS_PORT": str(metrics_port), "GRADSVC_LOG_LEVEL": "warning",
           "PYTHONUNBUFFERED": "1", **env_overrides}
    made = None
    if handoff and "GRADSVC_HANDOFF_DIR" not in env_overrides and "GRADSVC_HANDOFF_DIR" not in os.environ:
        made = handoff_dir(api_port)
        claim_handoff_dir(made)
        env["GRADSVC_HANDOFF_DIR"] = str(made)
    stack = Stack(redis=redis, env=env, api_port=api_port, metrics_port=metrics_port, handoff_dir=made, python=python)
    try:
        # The API and the workers import torch, litestar and rq at the same time (a worker needs only Redis):
        # a stack is ready in about the time of the slower import rather than of both one after the other.
        stack.start_api(wait=False)
        for _ in range(workers):
            stack.start_worker()
        wait_port(api_port, 120)
        stack.wait_ready(workers)
    except Exception:
        stack.stop()
        raise
    return stack


def start_up(cwd: Path, **env_overrides: str) -> tuple[subprocess.Popen, str]:
    """`gradsvc up` as a user runs it (its embedded Redis, free ports, this checkout importable), logging to
    cwd/up.log: (the process, the API's base URL)."""
    port = free_port()
    env = {**os.environ, "GRADSVC_PORT": str(port), "GRADSVC_WORKER_METRICS_PORT": str(free_port()),
           "GRADSVC_LOG_LEVEL": "warning",
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p),
           **env_overrides}
    env.pop("GRADSVC_REDIS_URL", None)
    with open(cwd / "up.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gradsvc", "up"], cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(http: httpx.Client, timeout_s: float = 60, why=lambda: "/readyz never answered 200") -> float:
    """GET /readyz every 0.2 s until it answers 200 (asserting within timeout_s, `why()` the message): the
    seconds it took."""
    started = time.monotonic()
    while True:
        try:
            if http.get("/readyz").status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        assert time.monotonic() - started < timeout_s, why()
        time.sleep(0.2)


def wait_status(http: httpx.Client, job_id: str, statuses: tuple[str, ...] = ("finished", "failed", "canceled"),
                timeout_s: float = 60) -> dict:
    """GET /jobs/{id} every 0.2 s until its status is one of `statuses` (or timeout_s passed): the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = http.get(f"/jobs/{job_id}").json()
        if job.get("status") in statuses or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


def wait_started(redis, job_ids: list[str], count: int, timeout_s: float = 60) -> list[str]:
    """Polls the RQ job hashes until `count` of these jobs are started (or timeout_s passed): their ids."""
    from rq.job import Job

    deadline = time.monotonic() + timeout_s
    while True:
        running = [j for j in job_ids if redis.hget(Job.key_for(j), "status") == b"started"]
        if len(running) == count or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def module_stack(workers: int = 1, **settings: str):
    """A module-scoped fixture of a stack of its own (start_stack's arguments), stopped after the module:
    `my_stack = module_stack(2, GRADSVC_WORKER_HEARTBEAT_S="1")` in a test module."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture():
        s = start_stack(workers=workers, **settings)
        yield s
        s.stop()

    return fixture


def client_fixtures(stack_fixture: str):
    """`http` and `redis` fixtures over the module's own stack fixture (named `stack_fixture`):
    `http, redis = client_fixtures("my_stack")` in a test module."""
    import pytest

    @pytest.fixture()
    def http(request):
        with request.getfixturevalue(stack_fixture).http_client() as client:
            yield client

    @pytest.fixture()
    def redis(request):
        with request.getfixturevalue(stack_fixture).redis_client() as r:
            yield r

    return http, redis


def sdk_fixture(stack_fixture: str):
    """A fixture of the SDK's Client over the module's own stack fixture (named `stack_fixture`), with its first API
    key: `client = sdk_fixture("my_stack")` in a test module."""
    import pytest

    @pytest.fixture()
    def client(request):
        with request.getfixturevalue(stack_fixture).sdk_client() as c:
            yield c

    return client
