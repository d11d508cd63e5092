"""The examples' command line: the script's docstring as its description, --base-url, and the script's
own integer flags, passed to its main()."""

from __future__ import annotations

import argparse
from typing import Callable


def run(main: Callable[..., object], doc: str, **flags: tuple[str, int, str]) -> None:
    """flags: main's keyword -> (flag, default, help); main is called as main(base_url, **keywords)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="the service (default $GRADSVC_URL or http://127.0.0.1:8000)")
    for keyword, (flag, default, help_) in flags.items():
        ap.add_argument(flag, dest=keyword, type=int, default=default, metavar="N", help=help_)
    args = vars(ap.parse_args())
    main(args.pop("base_url"), **args)
