"""The HTTP door: Litestar app factory, routes, error rendering, auth and API metrics."""

from .app import create_app

__all__ = ["create_app"]
