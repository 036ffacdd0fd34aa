"""A bucket that takes writes: created when missing, and probed until a PUT lands.

Some S3 servers answer the first PUTs into a bucket created a moment ago with
`500 InternalError` while the bucket spreads through their metadata layer
(SeaweedFS does under concurrent load). A user who starts kvmesh against a
fresh bucket should not meet that as a failed first upload, so a bucket this
call creates is written once (a tiny probe object, then deleted) before the
call returns; the server's transient answers are retried within `timeout_s`.
An existing bucket is trusted as it is: one request, no probe.
"""

from __future__ import annotations

import io
import time

from kvmesh.retry import Backoff
from minio import Minio
from minio.error import S3Error

TRANSIENT_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown"})  # S3's "try again"
PROBE_KEY = ".kvmesh-bucket-probe"


def ensure_bucket(client: Minio, bucket: str, timeout_s: float = 10.0) -> bool:
    """Create `bucket` when missing and wait until it takes a write; True if it was created here.

    Raises the server's error if it is not transient, or the last transient one after `timeout_s`.
    """
    if client.bucket_exists(bucket):
        return False
    try:
        client.make_bucket(bucket)
    except S3Error as exc:
        if exc.code not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:  # another process won the race
            raise
    _probe_write(client, bucket, timeout_s)
    return True


def _probe_write(client: Minio, bucket: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(0.05, 1.0)
    while True:
        try:
            client.put_object(bucket, PROBE_KEY, io.BytesIO(b"ok"), 2)
            client.remove_object(bucket, PROBE_KEY)
            return
        except S3Error as exc:
            wait = backoff.next()
            if exc.code not in TRANSIENT_CODES or time.monotonic() + wait > deadline:
                raise
            time.sleep(wait)
