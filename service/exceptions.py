"""ServiceError, the one exception a route raises, and the HTTP status of each code (gradsvc.wire.ERROR_CODES).

ServiceError            raised by routes; carries a code from gradsvc.wire.ERROR_CODES (the one table)
 (engine errors, Litestar's HTTP exceptions and Redis outages are mapped onto the same codes by
 service/error_responses.py, the one renderer)
"""

from __future__ import annotations

from typing import Any

from gradsvc.wire import ERROR_CODES

STATUS: dict[str, int] = {code: entry.status for code, entry in ERROR_CODES.items()}


class ServiceError(Exception):
    def __init__(self, code: str, message: str, headers: dict[str, str] | None = None, **detail: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail
        self.headers = headers or {}

    @property
    def status(self) -> int:
        return STATUS[self.code]


def status_for(code: str) -> int:
    return STATUS.get(code, 500)
