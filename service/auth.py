"""API keys (Bearer, compared in constant time) and per-key rate limiting.

A job belongs to the key that submitted it: the owner id is a digest of the key, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from litestar import Request
from redis import Redis

from gradsvc.broker import keys
from gradsvc.runtime.settings import Settings

from .exceptions import ServiceError

ANONYMOUS = keys.ANONYMOUS_OWNER


class Auth:
    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.keys = [k.encode() for k in settings.all_api_keys()]
        self.limit = settings.rate_limit_per_minute
        self.prefix = settings.queue_prefix
        self.redis = redis

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def owner(self, request: Request) -> str:
        if not self.keys:
            return ANONYMOUS
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ServiceError("unauthorized", "missing API key; send 'Authorization: Bearer <key>'",
                               headers={"WWW-Authenticate": "Bearer"})
        owner = self.owner_of_key(token.strip())
        if owner is None:
            raise ServiceError("unauthorized", "unknown API key; check the key or ask the operator for one",
                               headers={"WWW-Authenticate": "Bearer"})
        return owner

    def owner_of_key(self, key: str) -> str | None:
        """The owner id of a configured key, None for any other (the browser login form checks it too)."""
        given = key.encode()
        ok = False
        for known in self.keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(given, known)
        return hashlib.sha256(given).hexdigest()[:24] if ok else None

    def check_rate(self, owner: str) -> None:
        """Fixed one-minute windows per key, counted in Redis so every API process shares them."""
        if self.limit <= 0:
            return
        now = time.time()
        window = int(now // 60)
        key = keys.rate_key(self.prefix, owner, window)
        pipe = self.redis.pipeline(transaction=False)
        pipe.incr(key)
        pipe.expire(key, 120)
        count, _ = pipe.execute()
        if count > self.limit:
            retry = max(1, int(60 - now % 60))
            raise ServiceError("rate_limited", f"more than {self.limit} submissions this minute for this key "
                               f"(GRADSVC_RATE_LIMIT_PER_MINUTE={self.limit}); retry in {retry} s",
                               headers={"Retry-After": str(retry)}, retry_after_s=retry, limit=self.limit,
                               setting="GRADSVC_RATE_LIMIT_PER_MINUTE")
