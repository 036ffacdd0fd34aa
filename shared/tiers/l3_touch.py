"""Last-access refresh of L3 chunks: a read object older than a share of its TTL is rewritten in place, batched.

The GC (shared/eviction/l3_sweep.py) takes an object's S3 Last-Modified as
its last access, because a listing returns it and no per-object request is
needed. Reads must move it: a GET's response already carries the object's
Last-Modified and metadata, so noting a read costs no request. Once the
object is older than `refresh_share` of its TTL, its key joins a pending set;
every `interval_s` a flush copies each pending object onto itself with the
same metadata and a new `last-access` (S3 CopyObject: same bytes, a new
Last-Modified). So a chunk costs at most one copy per `refresh_share` x TTL
however often it is read, a read leaves it at least (1 - refresh_share) x TTL
to live, and TTL counts from the last read, not from creation.

Bounded: past `max_pending` keys a touch is dropped and counted (the object
lives from its previous refresh; its next read notes it again). Best effort:
a flush while S3 is away keeps nothing (the next reads note the keys again).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime

from minio import Minio
from minio.commonconfig import REPLACE, CopySource
from minio.error import MinioException, S3Error

_META = "x-amz-meta-"


@dataclass(slots=True)
class TouchStats:
    noted: int = 0  # reads of objects old enough to refresh
    copies: int = 0  # copy requests sent (one per pending key per flush)
    dropped: int = 0  # touches not kept: the pending set was full
    failed: int = 0  # copies S3 refused or could not answer (the object may be gone: fine)


@dataclass
class L3Touches:
    """Pending refreshes of one worker's L3 reads; `note` from any thread, `flush` from one."""

    refresh_share: float = 0.5  # refresh an object once it is older than this share of its TTL
    max_pending: int = 4096
    interval_s: float = 5.0
    stats: TouchStats = field(default_factory=TouchStats)
    _pending: dict[str, dict[str, str]] = field(default_factory=dict)  # key -> its metadata (x-amz-meta-*, bare)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, key: str, headers: Mapping[str, str], default_ttl_s: float, now: float | None = None) -> bool:
        """A GET of `key` answered with `headers`; True if the object is now pending a refresh."""
        lower = {k.lower(): v for k, v in headers.items()}
        try:
            modified = parsedate_to_datetime(lower["last-modified"]).timestamp()
        except (KeyError, TypeError, ValueError):
            return False
        meta = {k[len(_META):]: v for k, v in lower.items() if k.startswith(_META)}
        try:
            ttl = float(meta.get("ttl-s", default_ttl_s))
        except ValueError:
            ttl = float(default_ttl_s)
        now = time.time() if now is None else now
        if now - modified < ttl * self.refresh_share:
            return False
        with self._lock:
            if key not in self._pending and len(self._pending) >= self.max_pending:
                self.stats.dropped += 1
                return False
            self._pending[key] = meta
            self.stats.noted += 1
        return True

    def pending(self) -> int:
        return len(self._pending)

    def flush(self, client: Minio, bucket: str) -> int:
        """Copy every pending object onto itself with a fresh `last-access`; how many copies succeeded."""
        with self._lock:
            batch, self._pending = self._pending, {}
        done = 0
        for i, (key, meta) in enumerate(batch.items()):
            self.stats.copies += 1
            try:
                client.copy_object(bucket, key, CopySource(bucket, key),
                                   metadata={**meta, "last-access": f"{time.time():.0f}"},
                                   metadata_directive=REPLACE)
                done += 1
            except S3Error:
                self.stats.failed += 1  # gone meanwhile (GC, quarantine): nothing to refresh
            except (MinioException, OSError, ValueError):
                self.stats.failed += 1
                self.stats.dropped += len(batch) - i - 1  # S3 away: drop the rest; their next reads note them again
                break
        return done

    async def run(self, client: Minio, bucket: str) -> None:
        """Flush every `interval_s` until cancelled; the final flush is the owner's (`flush`)."""
        while True:
            await asyncio.sleep(self.interval_s)
            if self._pending:
                await asyncio.to_thread(self.flush, client, bucket)
