"""Redis Sentinel as a setting (GRADSVC_REDIS_SENTINELS, GRADSVC_REDIS_SENTINEL_MASTER): a master, a
replica and three sentinels (real `redis-server --sentinel` processes on free ports), the API and two
workers connected through the sentinels; the master is killed mid-load and the replica takes over. Every
SDK call ends finished once or with a code its client saw; no job is lost or run twice."""

from __future__ import annotations

import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from redis.sentinel import MasterNotFoundError, Sentinel

from gradsvc.runtime.launcher import free_port, redis_server_binary, wait_port

from ..support.stack import RedisServer, start_stack
from .load import account, run_load

# A master, a replica, three sentinels and a two-worker stack: ~30 s here, over the suite's budget with the
# rest; `make test-all` runs it (docs/testing.md).
pytestmark = pytest.mark.slow

MASTER = "gradsvc-test"
FAST_SYNC = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")


def _start_sentinel(port: int, master_port: int, workdir: Path) -> subprocess.Popen:
    conf = workdir / f"sentinel-{port}.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
                    f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 2\n"
                    f"sentinel down-after-milliseconds {MASTER} 800\n"
                    f"sentinel failover-timeout {MASTER} 4000\n")
    proc = subprocess.Popen([redis_server_binary(), str(conf), "--sentinel", "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL)
    wait_port(port)
    return proc


def _master_port(manager: Sentinel) -> int | None:
    try:
        return manager.discover_master(MASTER)[1]
    except MasterNotFoundError:  # the master is down and no replica is promoted yet
        return None


def _wait(what: str, ok, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.1)


@pytest.fixture()
def sentinel_stack():
    workdir = Path(tempfile.mkdtemp(prefix="gradsvc-sentinel-"))
    master = RedisServer(free_port(), args=(*FAST_SYNC, "--dir", str(workdir))).start()
    replica = RedisServer(free_port(), args=(*FAST_SYNC, "--dir", str(workdir), "--replicaof", "127.0.0.1",
                                             str(master.port))).start()
    ports = [free_port() for _ in range(3)]
    sentinels = [_start_sentinel(p, master.port, workdir) for p in ports]
    manager = Sentinel([("127.0.0.1", p) for p in ports], socket_timeout=1)
    stack = None
    try:
        # Each sentinel knows the replica and the two others (hello messages, every ~2 s): a failover can run.
        _wait("the sentinels found each other and the replica",
              lambda: all(len(s.sentinel_sentinels(MASTER)) == 2 and len(s.sentinel_slaves(MASTER)) == 1
                          for s in manager.sentinels))
        stack = start_stack(workers=2, redis=master, GRADSVC_REDIS_SENTINELS=",".join(f"127.0.0.1:{p}" for p in ports),
                            GRADSVC_REDIS_SENTINEL_MASTER=MASTER, GRADSVC_WORKER_HEARTBEAT_S="1",
                            GRADSVC_REDIS_TIMEOUT_S="1")
        yield stack, manager, master, replica
    finally:
        if stack is not None:  # the test is over: no warm shutdown to wait for with the master gone
            for p in [stack.api, *stack.workers]:
                if p is not None:
                    p.kill()
            stack.stop()
        master.stop()
        replica.stop()
        for s in sentinels:
            s.terminate()
            s.wait(timeout=10)


def test_the_master_dies_mid_load_the_replica_takes_over_and_no_job_is_lost_or_run_twice(sentinel_stack):
    stack, manager, master, replica = sentinel_stack
    assert manager.discover_master(MASTER) == ("127.0.0.1", master.port)
    done = threading.Event()
    outcomes: list = []
    load = threading.Thread(target=lambda: outcomes.extend(run_load(stack.base_url, 4, 10, done)))
    load.start()
    with stack.redis_client() as r:  # the master, until it dies
        _wait("a third of the load enqueued", lambda: sum(1 for _ in r.scan_iter("rq:job:*")) >= 12, 60)
    master.proc.send_signal(signal.SIGKILL)
    master.proc.wait()
    killed = time.monotonic()
    _wait("the sentinels promoted the replica", lambda: _master_port(manager) == replica.port)
    print(f"failover: the replica was master {time.monotonic() - killed:.1f} s after the kill")
    load.join(timeout=120)
    assert done.is_set(), f"the load did not end; logs in {stack.logdir}"
    with manager.master_for(MASTER, socket_timeout=2) as r:
        figures = account(outcomes, r)
    print("sentinel failover:", figures)
    assert figures["calls"] == 40
    assert all(p.poll() is None for p in stack.workers), f"a worker exited; logs in {stack.logdir}"
