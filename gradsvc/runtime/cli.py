"""`gradsvc serve | worker | up`: the API, one worker, or the whole stack on one machine.

Every flag overrides the GRADSVC_* variable of the same name (GRADSVC_HOST, GRADSVC_PORT,
GRADSVC_WORKERS, GRADSVC_WORKER_DEVICE, GRADSVC_REDIS_URL); the rest of the settings come from the
environment only (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable

from gradsvc import __version__
from .settings import Settings, SettingsError

# flag -> Settings field; each subcommand takes the flags that mean something to it, with the same help.
_FLAGS = {
    "host": ("host", str, "interface to bind the API (and a worker's metrics endpoint) to (GRADSVC_HOST, "
                          "default 127.0.0.1)"),
    "port": ("port", int, "the API's port (GRADSVC_PORT, default 8000)"),
    "workers": ("workers", int, "how many workers `up` starts; each worker splits the CPU cores by it "
                                "(GRADSVC_WORKERS, default 1)"),
    "device": ("worker_device", str, "auto (a GPU when present), cpu or cuda (GRADSVC_WORKER_DEVICE)"),
    "redis-url": ("redis_url", str, "the Redis to queue on (GRADSVC_REDIS_URL; `up` starts an embedded one when "
                                    "neither is given)"),
}
# Each process's entry point, "module:function", called with the Settings (and the worker's index and burst).
# The command starts what the layers above it define without importing them, as the API enqueues the job
# functions by dotted path (gradsvc/broker/job.py): no import runs from gradsvc up to service/ or workers/, and
# `gradsvc up` (launcher.py) starts each as `python -m gradsvc serve | worker`. tests/gradsvc/runtime/test_cli.py
# pins each path to its function.
ENTRY_POINTS = {
    "serve": "service.http_server:serve",
    "worker": "workers.main:run",
}
_COMMANDS = {
    "serve": ("run the HTTP API (uvicorn)", ["host", "port", "redis-url"]),
    "worker": ("run one RQ worker (no fork per job)", ["host", "workers", "device", "redis-url"]),
    "up": ("an embedded Redis (unless GRADSVC_REDIS_URL or --redis-url is given), the API and N supervised workers",
           ["host", "port", "workers", "device", "redis-url"]),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsvc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"gradsvc {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{serve,worker,up}")
    for name, (help_text, flags) in _COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        for flag in flags:
            field, kind, flag_help = _FLAGS[flag]
            cmd.add_argument(f"--{flag}", dest=field, type=kind, metavar=flag.upper().replace("-", "_"), help=flag_help)
        if name == "worker":
            cmd.add_argument("--index", type=int, default=0,
                             help="this worker's number i: its metrics port is GRADSVC_WORKER_METRICS_PORT + i "
                                  "and, with CUDA, it takes GPU i mod the GPU count (default 0)")
            cmd.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    return p


def entry_point(command: str) -> Callable[..., None]:
    """The function ENTRY_POINTS names for `command`, imported now."""
    module, _, function = ENTRY_POINTS[command].partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    overrides = {field: getattr(args, field) for field, _, _ in _FLAGS.values()
                 if getattr(args, field, None) is not None}
    if "redis_url" in overrides:
        overrides["redis_url_given"] = True
    try:
        settings = Settings.from_env(**overrides)
    except SettingsError as exc:
        p.exit(2, f"gradsvc: bad setting: {exc}\n")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "serve":
        entry_point("serve")(settings)
    elif args.command == "worker":
        entry_point("worker")(settings, index=args.index, burst=args.burst)
    else:
        from .launcher import Launcher

        sys.exit(Launcher(settings, redis_from_env=settings.redis_url_given).run())


if __name__ == "__main__":
    main()
