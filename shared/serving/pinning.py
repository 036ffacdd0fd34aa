"""Pins from cache_control breakpoints and named caches: keep a prompt prefix for a TTL.

A pin covers the whole blocks of its first `num_tokens` prompt tokens; they
are pinned in the engine (held out of eviction until the wall-clock
deadline) and in this worker's L2. Pinning an already pinned prefix moves
its deadline (a hit refreshes the TTL). `cache_created_tokens` is what the
pins wrote beyond what was already cached: the pinned whole-block tokens not
covered by the cached prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from shared.protocol.serving import CachePin
from shared.serving.engine_loop import EngineLoop
from shared.serving.worker_tiers import WorkerTiers


async def apply_pins(engine: EngineLoop, tiers: WorkerTiers, pins: Sequence[CachePin], hashes: Sequence[bytes],
                     cached_tokens: int) -> int:
    """Pin each prefix; returns cache_created_tokens."""
    if not pins:
        return 0
    bs = engine.engine.block_size
    wall, mono = time.time(), time.monotonic()
    longest = 0
    for pin in pins:
        n = min(pin.num_tokens // bs, len(hashes))
        prefix = list(hashes[:n])
        await engine.call(lambda e, p=prefix, until=wall + pin.ttl_s: e.pin(p, until))
        tiers.pin(prefix, mono + pin.ttl_s)
        longest = max(longest, n * bs)
    return max(0, longest - cached_tokens)
