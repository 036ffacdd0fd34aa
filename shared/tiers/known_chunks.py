"""The L3 chunks a worker knows are stored: a bounded, aging LRU set of chunk keys.

A hint that lets a writer skip a chunk with no encode and no S3 request (not
even the HEAD an idempotent write would cost). It is fed by what proves an
object exists: this worker's own PUTs and HEADs, chunks it read back whole,
and the cache index. It can go stale, because objects also leave L3 where
this worker does not see it (the GC's TTL, quota and capacity cuts, another
reader's quarantine), so every entry ages out after `max_age_s`: a chunk
deleted behind this worker's back is rewritten at the latest that long after
(a reader meanwhile recomputes it; never a wrong answer, since reads verify).

Bound: `capacity` entries, least recently used first out; ~230 bytes each
(an LRU entry, a 32-byte hash + namespace key, a float), so
the default 65,536 keys (`TierSettings.l3_known_chunks`) hold ~15 MiB and
cover 16M tokens at 256-token chunks. Thread-safe: uploads run in threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvmesh.lru import BoundedLRU


class KnownChunks:
    def __init__(self, capacity: int, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.max_age_s = max_age_s
        self.clock = clock
        self._until: BoundedLRU[bytes, float] = BoundedLRU(max(capacity, 1))  # id -> when it stops being trusted
        self._lock = threading.Lock()

    @staticmethod
    def chunk_id(namespace: str, last_hash: bytes) -> bytes:
        """The compact identity of a chunk of one store (its key without the model fingerprint)."""
        return last_hash + namespace.encode()

    def __len__(self) -> int:
        return len(self._until)

    def __contains__(self, chunk_id: bytes) -> bool:
        with self._lock:
            until = self._until.use(chunk_id)
            if until is None:
                return False
            if until <= self.clock():
                self._until.pop(chunk_id)
                return False
            return True

    def add(self, chunk_id: bytes, max_age_s: float | None = None) -> None:
        """Known from now on, for `max_age_s` (at most the set's own age limit, e.g. an object's TTL)."""
        age = self.max_age_s if max_age_s is None else min(max_age_s, self.max_age_s)
        if self.capacity <= 0 or age <= 0:
            return
        with self._lock:
            self._until.put(chunk_id, self.clock() + age)

    def discard(self, chunk_id: bytes) -> None:
        with self._lock:
            self._until.pop(chunk_id, None)
