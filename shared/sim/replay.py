"""Replay a trace through an L1 (and optional L2) ``PolicyCache``: prefix hits per tier and modeled TTFT.

Time is the trace timestamp. Each request first counts its prefix hit (its
leading blocks cached in L1, then in L2), then its chain is touched or
inserted into L1 (subject to admission), never evicting the request's own
blocks; L1's evictions are demoted to L2 (``TieredCache``). A session-aware
policy's book is driven around each request (``SessionDriver``), exactly
as the eviction service drives it from turn events.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.cache_policy.base import EvictionPolicy
from kvmesh.cache_policy.policy_cache import BlockSpec
from kvmesh.cache_policy.queue_cache import QueuePolicy
from kvmesh.cache_policy.session import SessionAware
from kvmesh.sim.session_driver import SessionDriver
from kvmesh.sim.tiers import TieredCache
from kvmesh.sim.trace import Trace
from kvmesh.sim.ttft import TTFTModel

Progress = Callable[[int], None]

# The decode rate `kvmesh trace from-trajectories` stamps its turns with (--output-tokens-per-s).
DEFAULT_DECODE_TOKENS_PER_S = 50.0


@dataclass(slots=True, frozen=True)
class ReplayResult:
    policy: str
    capacity_blocks: int  # L1
    hit_blocks: int  # prefix hits in any tier
    input_blocks: int
    l1_hit_blocks: int = 0
    l2_capacity_blocks: int = 0
    ttft_s: tuple[float, ...] = ()  # per request, when a TTFT model was given
    prediction_errors_s: tuple[float, ...] = ()  # signed, session-aware policies only
    pinned_max: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.input_blocks if self.input_blocks else 0.0

    @property
    def l1_hit_rate(self) -> float:
        return self.l1_hit_blocks / self.input_blocks if self.input_blocks else 0.0

    @property
    def l2_hit_rate(self) -> float:
        return self.hit_rate - self.l1_hit_rate


@dataclass(slots=True)
class ReplayOptions:
    l2_capacity: int = 0
    pin_fraction: float | None = None  # session pins' share of L1 (None: the policy's own)
    # a turn's end (its outcome event) comes this long per output token after arrival; 0: at arrival
    decode_tokens_per_s: float = DEFAULT_DECODE_TOKENS_PER_S
    ttft: TTFTModel | None = None
    groups: bool = True  # sub-agents linked to the parents their trace lines name
    progress: Progress | None = None
    on_request: Callable[[int], None] | None = None  # before request i (an oracle follows the replay)
    tiers: list[TieredCache] = field(default_factory=list)  # receives the cache, for inspection


def replay(trace: Trace, policy: EvictionPolicy | QueuePolicy, capacity: int, progress: Progress | None = None,
           on_request: Callable[[int], None] | None = None, options: ReplayOptions | None = None) -> ReplayResult:
    """Run every request of ``trace`` in order through L1 of ``capacity`` blocks (and L2, per ``options``)."""
    opts = options or ReplayOptions()
    progress = progress or opts.progress
    on_request = on_request or opts.on_request
    cache = TieredCache(policy, capacity, opts.l2_capacity)
    opts.tiers.append(cache)
    driver = (SessionDriver(policy, cache, pin_fraction=opts.pin_fraction, decode_tokens_per_s=opts.decode_tokens_per_s,
                            groups=opts.groups)
              if isinstance(policy, SessionAware) else None)
    hits = l1_hits = total = 0
    ttft: list[float] = []
    for i, request in enumerate(trace.requests):
        if on_request is not None:
            on_request(i)
        session = driver.started(request) if driver is not None else None
        specs = [BlockSpec(block_hash=b, num_tokens=request.block_tokens(k)) for k, b in enumerate(request.blocks)]
        got = cache.request(specs, request.time_s)
        if driver is not None and session is not None:
            driver.ended(request, session)
        hits += got.l1 + got.l2
        l1_hits += got.l1
        total += len(specs)
        if opts.ttft is not None:
            l1_tok = sum(s.num_tokens for s in specs[: got.l1])
            l2_tok = sum(s.num_tokens for s in specs[got.l1: got.l1 + got.l2])
            ttft.append(opts.ttft.seconds(l1_tok, l2_tok, max(request.input_length, l1_tok + l2_tok)))
        if progress is not None:
            progress(1)
    return ReplayResult(
        policy.name, capacity, hits, total, l1_hits, opts.l2_capacity, tuple(ttft),
        tuple(driver.errors) if driver is not None else (), driver.pinned_max if driver is not None else 0,
    )


def summarize(values: tuple[float, ...]) -> dict[str, float] | None:
    """p50 / p99 / mean of a sample (None if empty)."""
    if not values:
        return None
    xs = sorted(values)
    return {
        "p50": xs[len(xs) // 2],
        "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))],
        "mean": statistics.fmean(xs),
    }


def never_evicting_hits(trace: Trace) -> tuple[int, ...]:
    """Per request, its leading blocks some earlier request held: the prefix hit of a cache that never evicts."""
    seen: set[bytes] = set()
    out = []
    for request in trace.requests:
        n = 0
        while n < len(request.blocks) and request.blocks[n] in seen:
            n += 1
        out.append(n)
        seen.update(request.blocks)
    return tuple(out)


def infinite_hit_rate(trace: Trace) -> ReplayResult:
    """The ceiling: a cache that never evicts (prefix semantics)."""
    hits = sum(never_evicting_hits(trace))
    return ReplayResult("infinite", trace.unique_blocks, hits, trace.input_blocks, hits)
