"""Restore a tier's blocks only when that beats recomputing them, at this worker's measured rates.

Each resolved chain teaches the gate how many seconds a block took to come
from each tier (the time its sources took to return the blocks, over the
blocks; not the import into the pool, which waits for the engine's step
and which a recompute pays too), and each prefill how many seconds a prompt token took to compute
here (the engine's time to the first token over the uncached tokens, its
queue included: what a request feels). Both are EWMAs. A tier slower per
block than recomputing a block is left out of the next restores, so its
blocks are recomputed; every `probe_every`-th request asks it anyway, so a
tier that got faster is measured again. Until both rates are known, every
tier is asked. Each choice is counted: `kvmesh_restore_choices_total{tier,
choice="restore"|"recompute"}`.

Like the router's cost model (shared/ingress/routing/cost.py) this prices a
block at min(fetch, recompute), but with this worker's own measurements at
the moment it decides, not the ingress's priors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvmesh.protocol.blocks import Tier
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

_LABELS = {Tier.L2: "l2", Tier.PEER: "peer", Tier.L3: "l3"}


@dataclass
class RestoreGate:
    block_size: int
    alpha: float = 0.2  # weight of the newest observation
    probe_every: int = 16  # a tier left out is still asked on every this-many-th request
    min_tokens: int = 64  # shorter prefills are dominated by fixed costs: no compute sample
    choices: PromCounter | None = None
    _restore_s_per_block: dict[Tier, float] = field(default_factory=dict)
    _compute_s_per_token: float | None = None
    _skipped: Counter = field(default_factory=Counter)

    @classmethod
    def create(cls, block_size: int, registry: CollectorRegistry) -> RestoreGate:
        choices = PromCounter("kvmesh_restore_choices", "Per request and tier: restore its blocks, or recompute "
                              "them because this worker computes faster than that tier restores.",
                              ("tier", "choice"), registry=registry)
        return cls(block_size, choices=choices)

    def observe_restore(self, blocks: Mapping[Tier, int], seconds: Mapping[Tier, float]) -> None:
        """One resolved chain: blocks imported per tier, and the seconds each tier's sources took to return them."""
        for tier, s in seconds.items():
            if (n := blocks.get(tier, 0)) > 0 and tier in _LABELS:
                self._restore_s_per_block[tier] = _ewma(self._restore_s_per_block.get(tier), s / n, self.alpha)

    def observe_compute(self, seconds: float | None, uncached_tokens: int) -> None:
        """One prefill: seconds to its first token for `uncached_tokens` computed."""
        if seconds is not None and seconds > 0 and uncached_tokens >= self.min_tokens:
            self._compute_s_per_token = _ewma(self._compute_s_per_token, seconds / uncached_tokens, self.alpha)

    def pays(self, tier: Tier) -> bool:
        """Whether to restore from `tier` for the request at hand (counted)."""
        restore, compute = self._restore_s_per_block.get(tier), self._compute_s_per_token
        if restore is None or compute is None or restore <= compute * self.block_size:
            return self._count(tier, True)
        self._skipped[tier] += 1
        return self._count(tier, self._skipped[tier] % self.probe_every == 0)

    def _count(self, tier: Tier, restore: bool) -> bool:
        if self.choices is not None and tier in _LABELS:
            self.choices.labels(_LABELS[tier], "restore" if restore else "recompute").inc()
        return restore


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)
