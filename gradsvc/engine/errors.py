"""The engine's exception tree; each error carries the wire code that the API and jobs report.

EngineError
 +-- SpecError            the request is invalid (422): unknown_layer, shape_mismatch, bad_weights,
 |                        bad_tensor, bad_loss, bad_target, bad_option, too_large; invalid_body (400) for a
 |                        layer list the schema cannot describe (an empty container, a layer without a type)
 +-- ComputeError         the computation failed on valid input: non_finite (422), out_of_memory (507)
"""

from __future__ import annotations

from typing import Any


class EngineError(Exception):
    code = "engine_error"

    def __init__(self, code: str, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


class SpecError(EngineError):
    """The request cannot be computed as written; the message says how to fix it."""


class ComputeError(EngineError):
    """A valid request whose computation failed."""
