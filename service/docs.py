"""Interactive API docs at /docs: Swagger UI over GET /schema, every asset served from the swagger-ui-py
package's copy of swagger-ui-dist (no CDN: it works air-gapped)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from litestar import Request, Response, get

from . import html
from .api_state import ApiState
from .pages import login_redirect

# Found without importing the package (its __init__ wires web frameworks this service does not use).
SWAGGER_UI = Path(importlib.util.find_spec("swagger_ui").submodule_search_locations[0]) / "static"
_SWAGGER_ASSETS = {"swagger-ui.css": "text/css", "swagger-ui-bundle.js": "text/javascript",
                   "favicon-32x32.png": "image/png", "favicon-16x16.png": "image/png"}
_OWN_ASSETS = {"docs.js": "text/javascript"}  # the initializer: a file, since the pages allow no inline script


@get("/docs", include_in_schema=False)
async def api_docs(request: Request, viewer: str | None, state: ApiState) -> Response:
    if viewer is None and state.settings.docs_require_key:
        return login_redirect(request)
    return html.page("docs.html")


@get("/docs/assets/{name:str}", include_in_schema=False)
async def docs_asset(name: str) -> Response:
    if name in _OWN_ASSETS:
        return html.asset(html.STATIC, _OWN_ASSETS, name)
    return html.asset(SWAGGER_UI, _SWAGGER_ASSETS, name)


ROUTES = [api_docs, docs_asset]
