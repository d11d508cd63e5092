"""`gradsvc serve | worker | up`: the API, one worker, or the whole stack on one machine."""

from __future__ import annotations

import argparse
import logging
import sys

from .settings import Settings, SettingsError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gradsvc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP API (uvicorn)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    worker = sub.add_parser("worker", help="run one RQ worker (no fork per job)")
    worker.add_argument("--index", type=int, default=0, help="metrics port = GRADSVC_WORKER_METRICS_PORT + index")
    worker.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    up = sub.add_parser("up", help="Redis (embedded unless GRADSVC_REDIS_URL is set), the API and N workers")
    up.add_argument("--workers", type=int)
    up.add_argument("--port", type=int)
    args = parser.parse_args(argv)

    overrides = {k: v for k, v in vars(args).items() if k in ("host", "port", "workers") and v is not None}
    try:
        settings = Settings.from_env(**overrides)
    except SettingsError as exc:
        parser.exit(2, f"gradsvc: bad setting: {exc}\n")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "serve":
        import uvicorn

        uvicorn.run("service.app:app_factory", factory=True, host=settings.host, port=settings.port,
                    log_level=settings.log_level.lower(), access_log=False)
    elif args.command == "worker":
        from workers.worker import run

        run(settings, index=args.index, burst=args.burst)
    else:
        from .launcher import Launcher

        sys.exit(Launcher(settings, redis_from_env=settings.redis_url_given).run())


if __name__ == "__main__":
    main()
