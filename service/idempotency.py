"""Idempotency-Key claims: a key this owner used within GRADSVC_IDEMPOTENCY_TTL_S names the job it enqueued
then, for the same body (by digest); a claim binds a new key to a new job, and is released if the enqueue fails."""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import xxhash
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gradsvc.broker import keys

from .epochs import Epochs
from .exceptions import ServiceError

# An Idempotency-Key's body digest tells a retry's body (the same bytes) from another body sent under a reused
# key: a 128-bit XXH3, 12.8 MB in 1.4 ms here against BLAKE3's 5.3 and SHA-256's 9.0. It need not be cryptographic:
# a key is its owner's alone (the claim is per owner), so only the owner could make two bodies collide, and all
# a collision gets them is their own earlier job's answer. Computed in a thread of its own for a large body,
# beside the write of the body's handoff file (it releases the GIL): the API's digest pool, made by create_app.
_DIGEST_INLINE_BYTES = 1 << 20
DIGEST_THREADS = 2
# A claim until its job is enqueued reads "<job id> <body digest> pending"; then "<job id> <digest>".
_PENDING = "pending"
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0
"""


def claim_value(job_id: str, digest: str) -> str:
    return f"{job_id} {digest}"


def still_pending(raw: bytes | None, value: str) -> bool:
    """Whether the claim read as `raw` is `value`'s (claim_value) and still pending."""
    return (raw or b"").startswith(f"{value} {_PENDING} ".encode())


def pending_value(job_id: str, digest: str) -> str:
    """The claim until the job is enqueued, with when it was made: a concurrent request with the key waits
    for it to be enqueued, a retry finding it older than PENDING_TAKEOVER_S takes it over."""
    return f"{claim_value(job_id, digest)} {_PENDING} {time.time():.3f}"


# A claim still pending this long after it was made belongs to an attempt that died between claiming and
# enqueueing (an enqueue takes milliseconds): a request with the same key and body then takes it over.
PENDING_TAKEOVER_S = 5.0
PENDING_POLL_S = 0.02


def body_digest(body: bytes, pool: Executor | None) -> "Future[str]":
    """The body's digest, on `pool` for a large body (None: here, as for a small one)."""
    if pool is None or len(body) < _DIGEST_INLINE_BYTES:
        done: Future[str] = Future()
        done.set_result(xxhash.xxh3_128_hexdigest(body))
        return done
    return pool.submit(xxhash.xxh3_128_hexdigest, body)


@dataclass(eq=False)
class IdempotencyClaims:
    redis: Redis
    epochs: Epochs
    prefix: str
    ttl_s: int  # GRADSVC_IDEMPOTENCY_TTL_S

    def key(self, owner: str, idempotency_key: str) -> str:
        """The claim's Redis key: keys are per owner."""
        return keys.idempotency_key(self.prefix, owner, idempotency_key)

    def claim(self, claim: str, job_id: str, digest: str, key_age_s: float | None = None,
              pending: bool = True) -> str | None:
        """Binds the key to `job_id` (None), or returns the job an earlier request bound it to. A retry
        (`key_age_s`) whose key is unknown while Redis's data is younger than the key was first sent may
        have had its record lost with that data: refused `job_lost` rather than run a second time.
        `pending`: the claim reads as such until the Enqueuer's transaction enqueues the job; a retry that
        finds it pending (the first attempt failed, or its API died, between claiming and enqueueing) takes
        it over and enqueues, where it would otherwise be told of a job that never existed."""
        mine = pending_value(job_id, digest) if pending else claim_value(job_id, digest)
        expired = 0
        while expired < 3:  # an earlier claim can expire between SET NX and GET: claim again
            if self.redis.set(claim, mine, nx=True, ex=self.ttl_s):
                if key_age_s is not None and self.epochs.began_within(key_age_s):
                    self.redis.delete(claim)
                    raise ServiceError("job_lost", f"this retry's Idempotency-Key was first sent {key_age_s:.1f} s "
                                       "ago, and Redis may have lost data since (restarted empty, or without its last "
                                       "writes, or failed over): whether the first "
                                       "attempt's job ran is unknown, so it is not run again; submit it with a new "
                                       "key if it should run", header="Idempotency-Key")
                return None
            earlier = self.redis.get(claim)
            if earlier is None:
                expired += 1
                continue
            earlier_id, earlier_digest, *state = earlier.decode().split(" ")
            if earlier_digest == digest and state:  # claimed, not yet enqueued
                made = float(state[1]) if len(state) > 1 else 0.0
                if time.time() - made < PENDING_TAKEOVER_S:
                    time.sleep(PENDING_POLL_S)  # another request with this key is enqueueing it now
                    continue
                if pending and self.redis.eval(_TAKE_OVER, 1, claim, earlier, mine, self.ttl_s):
                    return None  # its attempt died before enqueueing: this request enqueues it
                if pending:
                    continue
            if earlier_digest != digest:
                raise ServiceError("idempotency_key_reused", "Idempotency-Key was used for a different request "
                                   f"body within GRADSVC_IDEMPOTENCY_TTL_S ({self.ttl_s} s), by job "
                                   f"{earlier_id}; send a new key with a new request", header="Idempotency-Key",
                                   job_id=earlier_id)
            return earlier_id
        return None

    def release(self, claim: str) -> None:
        """Nothing was enqueued under the claim: a retry under the same key must enqueue it."""
        try:
            self.redis.delete(claim)
        except (RedisConnectionError, RedisTimeoutError):
            pass
