"""The service's pin table: block hash -> unix time until which it is kept.

Pins come from cache_control breakpoints and named caches (`EVICTION_PIN`).
A pin only ever extends; `expire` forgets the ones whose time has passed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class PinTable:
    _until: dict[bytes, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._until)

    def pin(self, hashes: Iterable[bytes], until: float) -> int:
        n = 0
        for h in hashes:
            self._until[h] = max(self._until.get(h, 0.0), until)
            n += 1
        return n

    def pinned(self, block_hash: bytes, now: float) -> bool:
        return self._until.get(block_hash, 0.0) > now

    def any_pinned(self, hashes: Iterable[bytes], now: float) -> bool:
        return any(self.pinned(h, now) for h in hashes)

    def until(self, block_hash: bytes) -> float:
        return self._until.get(block_hash, 0.0)

    def expire(self, now: float) -> int:
        done = [h for h, t in self._until.items() if t <= now]
        for h in done:
            del self._until[h]
        return len(done)
