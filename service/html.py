"""HTML answers: the Jinja2 templates under service/templates (autoescaped: every value from a request is
user data) and the policy that keeps the pages from loading anything from another host."""

from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from litestar import Response

HERE = Path(__file__).parent
STATIC = HERE / "static"
_env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=True, undefined=StrictUndefined,
                   trim_blocks=True, lstrip_blocks=True)
# Everything from this origin only: a page works air-gapped, and an injected tag could load nothing from
# elsewhere. Inline styles stay allowed (Swagger UI sets them; the bars are widths); inline scripts do not.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
           "Cache-Control": "no-store"}


def page(template: str, status_code: int = 200, cookies=None, **context) -> Response:
    return Response(_env.get_template(template).render(**context), status_code=status_code, media_type="text/html",
                    headers=HEADERS, cookies=cookies)


def asset(directory: Path, allowed: dict[str, str], name: str) -> Response:
    """One file of an allow-list (name -> media type) from `directory`, cacheable for a day."""
    from litestar.response import File

    from .exceptions import ServiceError

    if name not in allowed:
        raise ServiceError("not_found", f"no asset {name!r}", asset=name)
    return File(directory / name, media_type=allowed[name], content_disposition_type="inline",
                headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"})
