"""Where a request's cached prompt tokens came from, per tier, as the traffic record and TokenEvent say it."""

from __future__ import annotations

from collections.abc import Mapping

from kvmesh.protocol.blocks import Tier

# The resolver asks the tiers in this order, so the chain's leading run comes from the first ones.
_ORDER = ((Tier.L1, "l1"), (Tier.L2, "l2"), (Tier.PEER, "peer"), (Tier.L3, "l3"))


def tier_tokens(sources: Mapping[Tier, int], block_size: int, cached_tokens: int) -> dict[str, int]:
    """Tokens per tier from the blocks each tier gave (`sources`), summing exactly to `cached_tokens`: blocks
    the engine found that no source reported (a concurrent request stored them) count as L1, and blocks
    fetched past what the engine used are not counted."""
    out = {name: 0 for _, name in _ORDER}
    left = cached_tokens
    for tier, name in _ORDER:
        take = min(left, sources.get(tier, 0) * block_size)
        out[name] = take
        left -= take
    out["l1"] += left
    return out
