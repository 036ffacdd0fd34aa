"""Per-key rate limiting: a token bucket per API key (429 + Retry-After when empty)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.ingress.errors import ApiError, ErrorKind


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


@dataclass(slots=True)
class RateLimiter:
    """`rate_per_s` requests per second per key, bursts up to `burst`; buckets of idle keys are dropped."""

    rate_per_s: float
    burst: float
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def check(self, key: str) -> None:
        """Take one request's token from `key`'s bucket, or raise ApiError(rate_limit) with the wait."""
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.burst, now)
            if len(self._buckets) > 10_000:
                self._prune(now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate_per_s)
        bucket.stamp = now
        if bucket.tokens < 1.0:
            wait = (1.0 - bucket.tokens) / self.rate_per_s if self.rate_per_s > 0 else 60.0
            raise ApiError(ErrorKind.RATE_LIMIT, f"rate limit exceeded: retry in {wait:.1f}s", retry_after_s=wait)
        bucket.tokens -= 1.0

    def _prune(self, now: float) -> None:
        full = [k for k, b in self._buckets.items() if b.tokens + (now - b.stamp) * self.rate_per_s >= self.burst]
        for k in full:
            del self._buckets[k]
