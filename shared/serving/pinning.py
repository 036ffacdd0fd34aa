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


def cache_created(pins: Sequence[CachePin], num_blocks: int, block_size: int, cached_tokens: int) -> int:
    """Tokens the pins write beyond the cached prefix: pinned whole blocks (of `num_blocks`) past it."""
    longest = max((min(p.num_tokens // block_size, num_blocks) * block_size for p in pins), default=0)
    return max(0, longest - cached_tokens)


async def apply_pins(engine: EngineLoop, tiers: WorkerTiers, pins: Sequence[CachePin], hashes: Sequence[bytes]) -> None:
    """Pin each prefix in the engine (wall-clock deadline) and in L2 (monotonic deadline)."""
    bs = engine.engine.block_size
    wall, mono = time.time(), time.monotonic()
    for pin in pins:
        prefix = list(hashes[: min(pin.num_tokens // bs, len(hashes))])
        await engine.call(lambda e, p=prefix, until=wall + pin.ttl_s: e.pin(p, until))
        tiers.pin(prefix, mono + pin.ttl_s)
