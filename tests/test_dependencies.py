"""What ships is what is imported: deptry (`make check-deps`) finds every third-party import of the server's trees
declared in the bare install or the `server` extra, and every import of the SDK in the bare install or its own
extras; the same check fails when a server import is declared only where a user's install does not reach it
(safetensors in `dev` alone, which once made `make run` exit at import). hadolint passes the Dockerfile, whose
dependency list is read from the same pyproject.toml."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SERVER_TREES = ("gradsvc", "service", "workers")


def _deptry(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "deptry"), "--no-ansi", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_every_server_import_is_declared_in_the_server_extra():
    out = _deptry(*SERVER_TREES)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_sdk_import_is_declared_in_the_bare_install_or_its_own_extras():
    out = _deptry("gradclient", "--optional-dependencies-dev-groups", "dev,bench,server")
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_server_import_declared_only_in_dev_fails_the_check(tmp_path):
    """safetensors moved from `server` to `dev`, as it was: the check names it and exits non-zero."""
    text = (ROOT / "pyproject.toml").read_text()
    server = tomllib.loads(text)["project"]["optional-dependencies"]["server"]
    line = next(d for d in server if d.startswith("safetensors"))
    moved = re.sub(rf'\n *"{re.escape(line)}",', "", text, count=1)
    moved = moved.replace('dev = [\n', f'dev = [\n    "{line}",\n', 1)
    assert "safetensors" not in "".join(tomllib.loads(moved)["project"]["optional-dependencies"]["server"])
    (tmp_path / "pyproject.toml").write_text(moved)
    for tree in SERVER_TREES:
        shutil.copytree(ROOT / tree, tmp_path / tree, ignore=shutil.ignore_patterns("__pycache__"))
    out = _deptry(*SERVER_TREES, cwd=tmp_path)
    said = out.stdout + out.stderr
    assert out.returncode == 1, said
    assert "gradsvc/engine/session_state.py" in said, said
    assert re.search(r"DEP004 'safetensors' imported but declared as a dev dependency", said), said


def test_the_dockerfile_passes_hadolint():
    out = subprocess.run([str(BIN / "hadolint"), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_image_installs_the_bare_dependencies_and_the_server_extra_from_pyproject():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "p['dependencies'] + p['optional-dependencies']['server']" in dockerfile
