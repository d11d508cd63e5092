# syntax=docker/dockerfile:1
# One image for the API and the workers; the command picks the role:
#   docker run gradsvc:cuda serve     the Litestar API on :8000   (the default command)
#   docker run gradsvc:cuda worker    an RQ worker, metrics on :9101
# VARIANT=cuda (default) builds on NVIDIA's CUDA runtime image with torch's CUDA wheel;
#   docker build --build-arg VARIANT=cpu -t gradsvc:cpu .
# builds on plain Ubuntu with the CPU wheel (about 1 GB smaller; enough for the API and CPU workers).
# Both bases are Ubuntu 24.04 (Python 3.12), so every step after FROM is the same for both.
# The CUDA tag and the torch index must match: torch 2.13.0's CUDA 13.0 wheels come from .../whl/cu130.
ARG VARIANT=cuda

FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04 AS base-cuda
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV TORCH_INDEX_URL=${TORCH_INDEX_URL}

FROM ubuntu:24.04 AS base-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV TORCH_INDEX_URL=${TORCH_INDEX_URL}

# base-cuda or base-cpu: a stage above, whose own FROM carries the image's tag.
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app

# Python and a venv; no compilers: every dependency installs from a wheel. Debian-style version pins would break
# the build whenever Ubuntu's archive moves on; the base image's tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && groupadd --system --gid 10001 gradsvc \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/gradsvc gradsvc

# torch alone in its own layer: the largest by far, and rebuilt only when the pin changes.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The other dependencies, read from pyproject.toml, in a layer that an edit to the code does not touch.
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['server']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" \
    && rm /tmp/requirements.txt /tmp/pyproject.toml

# The code last (a few hundred kB): run from /app on PYTHONPATH, no install step.
WORKDIR /app
COPY gradsvc/ /app/gradsvc/
COPY service/ /app/service/
COPY workers/ /app/workers/
COPY gradclient/ /app/gradclient/
COPY deploy/healthcheck.py /app/healthcheck.py

# Inside a container 127.0.0.1 is reachable from nowhere else: bind to every interface. Publish the
# ports on the host's loopback (as deploy/docker-compose.yml does) or set GRADSVC_API_KEYS.
ENV GRADSVC_HOST=0.0.0.0 \
    GRADSVC_PORT=8000 \
    GRADSVC_WORKER_METRICS_PORT=9101
EXPOSE 8000 9101

USER 10001:10001
# API: GET /healthz; worker: its metrics endpoint. start-period covers importing torch and, on a
# GPU, creating the CUDA context.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["python", "-m", "gradsvc"]
CMD ["serve"]
