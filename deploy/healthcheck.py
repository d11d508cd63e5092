"""The container HEALTHCHECK for both roles: healthy when the API answers GET /healthz on GRADSVC_PORT
(`gradsvc serve`) or the worker's metrics endpoint answers on GRADSVC_WORKER_METRICS_PORT (`gradsvc worker`).
Standard library only, so it runs in the image without curl."""

from __future__ import annotations

import os
import sys
import urllib.request


def main() -> int:
    urls = [f"http://127.0.0.1:{os.environ.get('GRADSVC_PORT', '8000')}/healthz",
            f"http://127.0.0.1:{os.environ.get('GRADSVC_WORKER_METRICS_PORT', '9101')}/metrics"]
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                if response.status == 200:
                    return 0
        except OSError:
            continue
    print(f"unhealthy: none of {urls} answered 200", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
