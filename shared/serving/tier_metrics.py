"""Where a worker's KV blocks came from, per tier, as Prometheus counters on its /metrics.

Every time a worker resolves a prompt's chain (prefill: the prompt's usable
blocks; decode: the handed-off handles), each block is counted once, at the
tier it came from: `l1` (already in the engine's pool), `l2` (this worker's
host memory), `peer` (another worker's L2) or `l3` (object storage); the
blocks no tier had are misses (recomputed). The `stage` label keeps a
prefill's lookup apart from decode's re-resolution of the same request, so
`sum(... {stage="prefill"})` over the fleet counts each request once. Bytes
are blocks x this worker's KV bytes per block. A restore's latency per tier is
the time from the start of the fetch until that tier's last block was in the
pool (L1 needs none and has no histogram).

Also exported here, read at scrape time from the objects that keep them: the
L3 upload queue's and store's counts, and the eviction commands this worker
applied (incl. prefetched blocks). Names and their vLLM / LMCache
equivalents: docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.l3_store import L3Stats
from kvmesh.tiers.upload_queue import UploadStats
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvmesh.engine.engine import Engine
    from kvmesh.serving.worker_tiers import WorkerTiers

TIER_LABELS = {Tier.L1: "l1", Tier.L2: "l2", Tier.PEER: "peer", Tier.L3: "l3"}
# From a shared-memory L2 read of one block (~100 us) to an L3 chain over a slow link (tens of seconds).
_RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class TierMetrics:
    """A worker's per-tier counters; `observe` once per resolved chain."""

    block_size: int  # tokens per block
    block_bytes: int  # KV bytes per block on this worker
    hit_blocks: Counter  # labels stage, tier
    hit_bytes: Counter  # labels stage, tier
    miss_blocks: Counter  # label stage
    restore_seconds: Histogram  # labels stage, tier (l2, peer, l3)
    queries: Counter  # vLLM-compatible: prompt tokens looked up (prefill)
    hits: Counter  # vLLM-compatible: of those, tokens found in some tier (prefill), label tier

    @classmethod
    def create(cls, registry: CollectorRegistry, block_size: int, block_bytes: int) -> TierMetrics:
        stage_tier = ("stage", "tier")
        return cls(
            block_size=block_size,
            block_bytes=block_bytes,
            hit_blocks=Counter("kvmesh_kv_hit_blocks", "Blocks of resolved chains found, by the tier they came from.",
                               stage_tier, registry=registry),
            hit_bytes=Counter("kvmesh_kv_hit_bytes", "KV bytes of the blocks found, by the tier they came from.",
                              stage_tier, registry=registry),
            miss_blocks=Counter("kvmesh_kv_miss_blocks", "Blocks of resolved chains no tier had (recomputed).",
                                ("stage",), registry=registry),
            restore_seconds=Histogram("kvmesh_kv_restore_seconds",
                                      "Seconds from a restore's start until its last block from this tier was in L1.",
                                      stage_tier, buckets=_RESTORE_BUCKETS, registry=registry),
            queries=Counter("kvmesh_prefix_cache_queries", "Prompt tokens a prefill looked up in the tiers "
                            "(as vllm:prefix_cache_queries).", registry=registry),
            hits=Counter("kvmesh_prefix_cache_hits", "Prompt tokens a prefill found in a tier "
                         "(as vllm:prefix_cache_hits, split by tier).", ("tier",), registry=registry),
        )

    def observe(self, stage: str, sources: Mapping[Tier, int], wanted: int,
                restore_s: Mapping[Tier, float] | None = None) -> None:
        """One resolved chain: `sources` blocks per tier (L1 included) out of `wanted` blocks looked up."""
        found = 0
        for tier, label in TIER_LABELS.items():
            n = sources.get(tier, 0)
            found += n
            self.hit_blocks.labels(stage, label).inc(n)
            self.hit_bytes.labels(stage, label).inc(n * self.block_bytes)
            if stage == "prefill":
                self.hits.labels(label).inc(n * self.block_size)
        self.miss_blocks.labels(stage).inc(max(0, wanted - found))
        if stage == "prefill":
            self.queries.inc(wanted * self.block_size)
        for tier, seconds in (restore_s or {}).items():
            if tier is not Tier.L1 and sources.get(tier, 0):
                self.restore_seconds.labels(stage, TIER_LABELS[tier]).observe(seconds)


class UploadCollector(Collector):
    """The L3 upload queue's and store's running counts (`UploadStats`, `L3Stats`), read at scrape time."""

    def __init__(self, uploads: Callable[[], UploadStats], store: Callable[[], L3Stats]) -> None:
        self.uploads, self.store = uploads, store

    def collect(self):
        u, s = self.uploads(), self.store()
        chunks = CounterMetricFamily("kvmesh_l3_upload_chunks", "Chunks offered to the L3 upload queue, by outcome "
                                     "(submitted = all the others + still pending).", labels=("outcome",))
        for outcome, n in (("submitted", u.chunks_submitted), ("written", u.chunks_written),
                           ("existing", u.chunks_existing), ("skipped_known", u.chunks_known),
                           ("coalesced", u.chunks_coalesced), ("dropped", u.chunks_dropped),
                           ("lost", u.chunks_lost), ("failed", u.chunks_failed)):
            chunks.add_metric((outcome,), n)
        yield chunks
        yield CounterMetricFamily("kvmesh_l3_upload_dropped_bytes", "Bytes the upload queue's budget could not hold.",
                                  value=u.dropped_bytes)
        yield CounterMetricFamily("kvmesh_l3_upload_retries", "Upload attempts retried while L3 was unavailable.",
                                  value=u.retries)
        yield CounterMetricFamily("kvmesh_l3_upload_deferred_chunks", "Chunks that waited for the worker to be idle "
                                  "(no request running, no chain being stored) before going out.",
                                  value=u.chunks_deferred)
        yield CounterMetricFamily("kvmesh_l3_put_bytes", "Object bytes this worker's successful L3 PUTs wrote "
                                  "(uploads and named caches).", value=s.bytes_put)
        requests = CounterMetricFamily("kvmesh_l3_write_requests", "S3 write-path requests (failed ones too).",
                                       labels=("kind",))
        requests.add_metric(("put",), s.put_requests)
        requests.add_metric(("head",), s.head_requests)
        yield requests


class CommandsCollector(Collector):
    """Blocks moved by the eviction commands this worker applied (`CommandResult` totals), read at scrape time.

    `prefetched` is the worker's side of the prefetch outcome: blocks brought back into L1 ahead of a
    session's predicted return (the eviction service counts sent, late and wasted prefetches).
    """

    _ACTIONS = ("moved", "dropped", "warmed", "retained", "prefetched", "skipped")

    def __init__(self, applied: Callable[[], object]) -> None:
        self.applied = applied

    def collect(self):
        done = self.applied()
        family = CounterMetricFamily("kvmesh_worker_command_blocks", "Blocks the eviction commands applied here "
                                     "touched, by action.", labels=("action",))
        for action in self._ACTIONS:
            family.add_metric((action,), getattr(done, action))
        yield family


class LocalEvictionCollector(Collector):
    """What this worker's own tiers let go of or refused, by reason, read at scrape time.

    L1: the engine's prefix cache evicts the policy's lowest block when an allocation needs room
    (`allocation`) and may refuse to cache a block (`not_admitted`); L2: the host tier evicts to
    make room (`capacity`) and refuses blocks it cannot hold (`refused`). The eviction service's
    advice is counted where it is decided (kvmesh_eviction_decided_blocks_total).
    """

    def __init__(self, engine_stats: Callable[[], object], l2: Callable[[], object]) -> None:
        self.engine_stats, self.l2 = engine_stats, l2

    def collect(self):
        cache, l2 = self.engine_stats(), self.l2()
        family = CounterMetricFamily("kvmesh_local_evicted_blocks", "Blocks this worker's tiers evicted or did not "
                                     "admit, by tier and reason.", labels=("tier", "reason"))
        family.add_metric(("l1", "allocation"), cache.evictions)
        family.add_metric(("l1", "not_admitted"), cache.rejected)
        family.add_metric(("l2", "capacity"), l2.evicted_blocks)
        family.add_metric(("l2", "refused"), l2.refused_blocks)
        yield family


class EnginePressureCollector(Collector):
    """What the engine took back from advice so that requests could run, read at scrape time.

    Pins and leases are advice: when nothing could run otherwise, the scheduler unpins idle pinned
    blocks (`kvmesh_l1_pins_yielded_blocks`) and breaks leases of queued requests
    (`kvmesh_l1_leases_broken`); it preempts running requests when the pool is short
    (`kvmesh_engine_preemptions`, as vllm:num_preemptions). Each costs a recompute, never a wait.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        sched = self.engine.scheduler
        yield CounterMetricFamily("kvmesh_l1_pins_yielded_blocks", "Pinned L1 blocks unpinned before their deadline "
                                  "because a request could not run otherwise.", value=self.engine.pins.num_yielded)
        yield CounterMetricFamily("kvmesh_l1_leases_broken", "Leases (blocks held for a queued request) ended because "
                                  "the next request could not be admitted otherwise.", value=sched.num_broken_leases)
        yield CounterMetricFamily("kvmesh_engine_preemptions", "Running requests preempted (recomputed later) for "
                                  "want of KV blocks.", value=sched.num_preemptions)


def export_worker_metrics(registry: CollectorRegistry, engine: Engine, tiers: WorkerTiers,
                          block_bytes: int) -> TierMetrics:
    """Register a worker's tier metrics on its registry: the per-chain counters (returned: the workers call
    `observe`) and the scrape-time views of its engine's cache, its L2, and its L3 uploads (when L3 is on)."""
    cache = engine.cache
    metrics = TierMetrics.create(registry, cache.block_size, block_bytes)
    registry.register(LocalEvictionCollector(lambda: cache.stats, lambda: tiers.l2))
    registry.register(EnginePressureCollector(engine))
    if tiers.uploads is not None and tiers.l3 is not None:
        uploads, l3 = tiers.uploads, tiers.l3
        registry.register(UploadCollector(lambda: uploads.stats, lambda: l3.stats))
    return metrics
