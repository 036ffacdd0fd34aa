"""A minio client that fails fast: the tiers retry and break circuits themselves.

The SDK's default pool retries a refused connection with backoff for seconds;
behind a circuit breaker that only delays the switch to recompute.
"""

from __future__ import annotations

import urllib3
from minio import Minio


def fast_fail_pool(connect_timeout_s: float = 1.0, read_timeout_s: float = 10.0,
                   maxsize: int = 16) -> urllib3.PoolManager:
    """The HTTP pool behind a fast-failing client: timeouts, no retries of any kind."""
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
        retries=urllib3.Retry(total=0, connect=0, read=0, redirect=0),
        maxsize=maxsize,
    )


def fast_fail_client(endpoint: str, access_key: str, secret_key: str, secure: bool = False,
                     connect_timeout_s: float = 1.0, read_timeout_s: float = 10.0) -> Minio:
    pool = fast_fail_pool(connect_timeout_s, read_timeout_s)
    return Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, http_client=pool)
