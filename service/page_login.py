"""The pages' login: the login form trades an API key for an HttpOnly cookie, which the HTML pages accept.

The cookie holds a random token, never the key; Redis maps the token's hash to the owner id for
LOGIN_TTL_S. The cookie is SameSite=Strict, so no other site's page can make the browser send it, and
it is honoured only by the read-only pages (GET /ui/..., /docs, /schema), never by the API's POST routes.
"""

from __future__ import annotations

import secrets
import time

from litestar import Request
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from litestar.datastructures import Cookie

from gradsvc.broker import keys

from .auth import ANONYMOUS, Auth
from .exceptions import ServiceError

COOKIE = "gradsvc_session"
# A working day: long enough to watch a few jobs, short enough that a forgotten browser loses access.
LOGIN_TTL_S = 8 * 3600


class PageLogin:
    """A browser's login to the pages: its cookie's token, who it is, and the throttle on wrong keys."""

    def __init__(self, auth: Auth, aredis, prefix: str, failures_per_minute: int = 10) -> None:
        self.auth = auth
        self.aredis = aredis
        self.prefix = prefix
        self.failures_per_minute = failures_per_minute

    async def login(self, key: str, client: str = "") -> str | None:
        """A new login's token for a configured key, None for any other. A client address with
        failures_per_minute wrong keys this minute is refused 429 until the minute ends: the form is no
        faster way to guess keys than the API."""
        now = time.time()
        failures = keys.login_failures_key(self.prefix, client, int(now // 60))
        if self.failures_per_minute > 0 and await self._failures(failures) >= self.failures_per_minute:
            retry = max(1, int(60 - now % 60))
            raise ServiceError("rate_limited", f"{self.failures_per_minute} wrong API keys from this address this "
                               f"minute (GRADSVC_LOGIN_FAILURES_PER_MINUTE); retry in {retry} s",
                               headers={"Retry-After": str(retry)}, retry_after_s=retry,
                               setting="GRADSVC_LOGIN_FAILURES_PER_MINUTE")
        owner = self.auth.owner_of_key(key.strip())
        if owner is None:
            try:
                pipe = self.aredis.pipeline(transaction=False)
                pipe.incr(failures)
                pipe.expire(failures, 120)
                await pipe.execute()
            except (RedisConnectionError, RedisTimeoutError):
                pass  # counted best effort: a wrong key is refused all the same
            return None
        token = secrets.token_urlsafe(32)
        await self.aredis.set(keys.page_login_key(self.prefix, token), owner, ex=LOGIN_TTL_S)
        return token

    async def _failures(self, key: str) -> int:
        try:
            return int(await self.aredis.get(key) or 0)
        except (RedisConnectionError, RedisTimeoutError):
            return 0  # no count to read: a wrong key is still refused, a right one needs Redis anyway

    async def logout(self, request: Request) -> None:
        token = request.cookies.get(COOKIE)
        if token:
            await self.aredis.delete(keys.page_login_key(self.prefix, token))

    async def owner(self, request: Request) -> str | None:
        """Who a page request is: the Bearer key when it sends one (a 401 if it is wrong), else its login
        cookie's owner, else anonymous when no keys are configured; None: the browser must log in."""
        if not self.auth.enabled:
            return ANONYMOUS
        if request.headers.get("authorization"):
            return self.auth.owner(request)
        token = request.cookies.get(COOKIE)
        if not token:
            return None
        owner = await self.aredis.get(keys.page_login_key(self.prefix, token))
        return owner.decode() if owner else None

    @staticmethod
    def cookie(request: Request, token: str, max_age: int = LOGIN_TTL_S) -> Cookie:
        return Cookie(key=COOKIE, value=token, max_age=max_age, path="/", httponly=True, samesite="strict",
                      secure=request.url.scheme == "https")
