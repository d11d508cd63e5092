"""What every wire module shares: the constraints the API refuses at decode, and the encoders."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

# Constraints the API refuses at decode (400 invalid_body, with the path); the OpenAPI document declares them.
NonEmpty = Meta(min_length=1)
AtLeastOne = Annotated[int, Meta(ge=1)]

JSON_ENCODER = msgspec.json.Encoder()
MSGPACK_ENCODER = msgspec.msgpack.Encoder()
