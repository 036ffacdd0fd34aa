"""Request limits: a token bucket per API key (429 + Retry-After when empty), and the shape of a JSON body."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.ingress.core.errors import ApiError, ErrorKind, invalid

# Deeper bodies are refused (400): nothing the dialects define nests past ~20 (a tool's JSON schema), and deep
# values would reach code that recurses (validation, schema compilers, json.dumps) and fail there as a 500.
MAX_JSON_DEPTH = 64


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


def check_json_tree(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """400 (ApiError) for a parsed JSON value nested deeper than `max_depth` or holding a string that is not
    valid Unicode (a lone surrogate such as "\\ud800" parses, but cannot be encoded or tokenized).

    Iterative, so the check itself cannot hit the recursion limit; it visits each node once."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > max_depth:
            raise invalid(f"the request body nests deeper than {max_depth} levels")
        if isinstance(node, dict):
            for key, item in node.items():
                _check_text(key)
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in node)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("the request body holds a string that is not valid Unicode (a lone surrogate)") from None
