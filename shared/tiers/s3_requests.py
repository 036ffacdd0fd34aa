"""A minio client that counts the S3 requests it sends, by operation: what a GC pass or a bench costs S3.

Counting happens in the SDK's one request path (`Minio._url_open`), so every
call (listings' pages, HEADs, ranged GETs, copies, batched deletes) counts
once per HTTP request, retries included.
"""

from __future__ import annotations

import threading
from collections import Counter

from kvmesh.tiers.s3_client import fast_fail_pool
from minio import Minio


class CountingMinio(Minio):
    """`requests[op]`: LIST, GET, HEAD, PUT, COPY, DELETE, DELETE_MULTI (1,000 keys a request), OTHER."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def _url_open(self, method, region, bucket_name=None, object_name=None, body=None, headers=None,
                  query_params=None, **kwargs):
        op = _operation(method, object_name, query_params or {}, headers or {})
        with self._count_lock:
            self.requests[op] += 1
        return super()._url_open(method, region, bucket_name, object_name, body=body, headers=headers,
                                 query_params=query_params, **kwargs)

    def reset(self) -> Counter[str]:
        """The counts so far; counting starts again from zero."""
        with self._count_lock:
            out, self.requests = self.requests, Counter()
        return out


def counting_client(endpoint: str, access_key: str, secret_key: str, secure: bool = False,
                    pool_size: int = 16) -> CountingMinio:
    """Like `fast_fail_client` (no SDK retries), counting; the region is fixed so no location lookup is sent."""
    pool = fast_fail_pool(read_timeout_s=30.0, maxsize=pool_size)
    return CountingMinio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure,
                         http_client=pool, region="us-east-1")


def _operation(method: str, object_name, query: dict, headers: dict) -> str:
    if method == "GET":
        return "GET" if object_name else ("LIST" if "list-type" in query or not query else "OTHER")
    if method == "PUT" and object_name:
        return "COPY" if any(k.lower() == "x-amz-copy-source" for k in headers) else "PUT"
    if method == "POST" and "delete" in query:
        return "DELETE_MULTI"
    if method in ("HEAD", "DELETE"):
        return method
    return "OTHER"
