"""Why a tier did not return a block, and how often.

A miss is never an error to the caller: it means "recompute or try the next
tier". Every miss carries a reason so corruption, staleness and outages are
counted separately instead of hiding inside a hit rate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from kvmesh.protocol.blocks import Tier


class MissReason(str, Enum):
    NOT_FOUND = "not_found"
    BAD_MAGIC = "bad_magic"
    UNKNOWN_VERSION = "unknown_version"
    TRUNCATED = "truncated"
    CHECKSUM = "checksum"
    FINGERPRINT = "fingerprint"
    WRONG_BLOCK = "wrong_block"  # verified bytes, but of another block than asked for
    TIER_DOWN = "tier_down"  # circuit open or tier disabled: failed fast
    UNAVAILABLE = "unavailable"  # the call failed (connection, timeout, server error)


class BlockMiss(Exception):
    """Raised by decoders; tiers turn it into a counted `Miss`."""

    def __init__(self, reason: MissReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


@dataclass(slots=True, frozen=True)
class Miss:
    tier: Tier
    reason: MissReason
    detail: str = ""


@dataclass(slots=True)
class MissCounters:
    """Counts of misses per (tier, reason); one object per worker, passed to its tiers."""

    counts: Counter = field(default_factory=Counter)

    def record(self, miss: Miss) -> Miss:
        self.counts[(miss.tier, miss.reason)] += 1
        return miss

    def get(self, tier: Tier, reason: MissReason) -> int:
        return self.counts[(tier, reason)]

    def total(self, reason: MissReason | None = None) -> int:
        return sum(n for (_, r), n in self.counts.items() if reason is None or r == reason)

    def export(self, registry) -> None:
        """Expose the counts as `kvmesh_tier_miss_total{tier,reason}` on a prometheus registry (read at scrape)."""
        from prometheus_client.core import CounterMetricFamily

        counts = self.counts

        class _Collector:
            def collect(self):
                family = CounterMetricFamily("kvmesh_tier_miss", "Tier misses by tier and reason.",
                                             labels=("tier", "reason"))
                for (tier, reason), n in list(counts.items()):
                    family.add_metric((tier.value, reason.value), n)
                yield family

        registry.register(_Collector())
