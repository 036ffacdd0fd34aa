"""One lock per key, for threads that must not interleave a read-then-write of the same object.

L3 writers stat an object and then PUT it, or rewrite its TTL (l3_store.py);
two writers of one chunk in this process (the upload queue, a named cache)
hold the key's lock across both steps. An entry exists only while someone
holds or waits for it, so the map stays as small as the writes in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class KeyLocks:
    """One lock per object key, held while a writer stats and writes it; entries go when nobody holds them."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._held.get(key, (None, 0))
            lock = lock or threading.Lock()
            self._held[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._held[key]
                if users == 1:
                    del self._held[key]
                else:
                    self._held[key] = (lock, users - 1)
