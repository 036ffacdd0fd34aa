"""TinyLFU-style admission in front of LRU: a block is cached from its second request on.

Most blocks of a trace are requested once (the unique tail of a prompt);
caching them evicts blocks that would have hit. The doorkeeper is an
``AccessHistory``: a missed block is admitted only if the history has seen
it before, so one-hit blocks never displace anything. Admitted blocks are
ordered by recency (the "main" LRU of W-TinyLFU).
"""

from __future__ import annotations

from kvmesh.cache_policy.base import BlockInfo
from kvmesh.cache_policy.history import DEFAULT_HISTORY_ENTRIES, AccessHistory


class TinyLFUPolicy:
    name = "tinylfu"

    def __init__(self, history_entries: int = DEFAULT_HISTORY_ENTRIES, min_count: int = 2) -> None:
        self.history = AccessHistory(history_entries)
        self.min_count = min_count

    def on_access(self, block_hash: bytes, now: float) -> None:
        self.history.record(block_hash)

    def priority(self, info: BlockInfo, now: float) -> float:
        return info.last_access

    def admit(self, info: BlockInfo, now: float) -> bool:
        return self.history.count(info.block_hash) >= self.min_count
