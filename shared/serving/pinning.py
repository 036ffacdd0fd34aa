"""Pins from cache_control breakpoints and named caches: keep a prompt prefix for a TTL.

A pin covers the whole blocks of its first `num_tokens` prompt tokens; they
are pinned in the engine (held out of eviction until the wall-clock
deadline) and in this worker's L2, each within its budgets: the engine's
`PinSet` (engine.pin_fraction of the pool, engine.pin_tenant_fraction per
tenant) and `L2Pins` (pins.l2_fraction / pins.l2_tenant_fraction of L2).
Past a budget a pin keeps the leading run that fits and the request goes on:
the ingress already refused, with a 429, what passes the tenant's
deployment-wide cap (shared/ingress/admission/pins.py); a worker's pool full
for everyone degrades silently (logged). Pinning an already pinned prefix
moves its deadline (a hit refreshes the TTL). `cache_created_tokens` is
what the pins wrote beyond what was already cached: the pinned whole-block
tokens not covered by the cached prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.cache_policy.pin_ledger import PinLedger
from kvmesh.config import PinQuotaSettings
from kvmesh.log import get_logger
from kvmesh.protocol.serving import CachePin
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.worker_tiers import WorkerTiers

log = get_logger(__name__)


def cache_created(pins: Sequence[CachePin], num_blocks: int, block_size: int, cached_tokens: int) -> int:
    """Tokens the pins write beyond the cached prefix: pinned whole blocks (of `num_blocks`) past it."""
    longest = max((min(p.num_tokens // block_size, num_blocks) * block_size for p in pins), default=0)
    return max(0, longest - cached_tokens)


@dataclass
class L2Pins:
    """This worker's L2 pin budget, in bytes, with monotonic deadlines (as L2's own pins)."""

    ledger: PinLedger
    block_bytes: int  # bytes one pinned block is counted at

    @classmethod
    def for_tier(cls, settings: PinQuotaSettings, capacity_bytes: int, block_bytes: int) -> L2Pins:
        return cls(PinLedger(int(capacity_bytes * settings.l2_fraction),
                             int(capacity_bytes * settings.l2_tenant_fraction)), max(1, block_bytes))


@dataclass(frozen=True, slots=True)
class PinOutcome:
    """Blocks pinned per tier, of `wanted` (the longest pin's blocks); `cut` names the budgets that cut a pin."""

    l1: int
    l2: int
    wanted: int
    cut: tuple[str, ...] = ()


async def apply_pins(engine: EngineLoop, tiers: WorkerTiers, pins: Sequence[CachePin], hashes: Sequence[bytes],
                     tenant: str = "", l2: L2Pins | None = None) -> PinOutcome:
    """Pin each prefix for `tenant` in the engine (wall-clock deadline) and in L2 (monotonic), within budgets.

    `l2` None: L2 pins are bound by nothing but L2 itself (tests, tools).
    """
    bs = engine.engine.block_size
    wall, mono = time.time(), time.monotonic()
    n1 = n2 = wanted = 0
    cut: set[str] = set()
    for pin in sorted(pins, key=lambda p: -p.num_tokens):  # the longest first: the others only extend it
        prefix = list(hashes[: min(pin.num_tokens // bs, len(hashes))])
        wanted = max(wanted, len(prefix))
        g1 = await engine.call(lambda e, p=prefix, until=wall + pin.ttl_s: e.pins.pin_for(tenant, p, until, wall))
        n1 = max(n1, g1.granted)
        if g1.refused is not None:
            cut.add(f"l1 {g1.refused.value}")
        keep = prefix
        if l2 is not None:
            g2 = l2.ledger.grant(tenant, prefix, l2.block_bytes, mono + pin.ttl_s, mono, trim=True)
            keep = prefix[:g2.granted]
            if g2.refused is not None:
                cut.add(f"l2 {g2.refused.value}")
        tiers.pin(keep, mono + pin.ttl_s)
        n2 = max(n2, len(keep))
    outcome = PinOutcome(n1, n2, wanted, tuple(sorted(cut)))
    if cut:
        log.info("pins cut short by a budget", tenant=tenant, l1=n1, l2=n2, wanted=wanted, budgets=outcome.cut)
    return outcome
