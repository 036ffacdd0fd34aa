"""Prometheus collectors of the eviction service, in the service's own registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.eviction.sessions import RetentionCounts
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

# Seconds between a session's predicted and actual return: tool calls land in the first buckets.
_ERROR_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


@dataclass(frozen=True, slots=True)
class EvictionMetrics:
    commands: Counter  # label kind: demote | warm
    decided_blocks: Counter  # blocks advised out of a tier, labels tier (l1 | l2), reason: watermark | session_ended
    l3_deleted: Counter  # label reason: expired | over_quota | over_capacity | damaged
    prediction_error: Histogram  # |predicted - actual| next-turn arrival, label direction: early | late

    @classmethod
    def create(cls, registry: CollectorRegistry, pins: Callable[[], float], workers: Callable[[], float],
               l3_objects: Callable[[], float], retention: RetentionCounts | None = None) -> EvictionMetrics:
        for name, doc, fn in (
            ("kvmesh_eviction_pins", "Block hashes pinned now.", pins),
            ("kvmesh_eviction_workers", "Workers whose occupancy the service tracks.", workers),
            ("kvmesh_eviction_l3_objects", "L3 chunk objects the latest scan left.", l3_objects),
        ):
            Gauge(name, doc, registry=registry).set_function(fn)
        if retention is not None:
            registry.register(_RetentionCollector(retention))
        return cls(
            commands=Counter("kvmesh_eviction_commands", "Commands sent to workers.", ("kind",), registry=registry),
            decided_blocks=Counter("kvmesh_eviction_decided_blocks", "Blocks the service advised a worker to move "
                                   "out of a tier, by tier and reason.", ("tier", "reason"), registry=registry),
            l3_deleted=Counter("kvmesh_eviction_l3_deleted", "L3 objects deleted by GC.", ("reason",),
                               registry=registry),
            prediction_error=Histogram("kvmesh_session_return_prediction_error_seconds",
                                       "How far a session's next turn arrived from its predicted time.",
                                       ("direction",), buckets=_ERROR_BUCKETS, registry=registry),
        )

    def observe_errors(self, counts: RetentionCounts) -> None:
        """Export the prediction errors the retention planner collected (signed: > 0 = came back later)."""
        for err in counts.errors:
            self.prediction_error.labels("late" if err > 0 else "early").observe(abs(err))
        counts.errors.clear()


class _RetentionCollector(Collector):
    """The session planner's running counts, read at scrape time."""

    _FIELDS = (
        ("retains", "Session chains the service asked a worker to keep in L1."),
        ("prefetches", "Session chains fetched back into L1 ahead of their predicted return."),
        ("late_prefetches", "Sessions that came back before their prefetch was sent."),
        ("wasted_prefetches", "Prefetched sessions whose pin lapsed before they came back."),
        ("budget_refusals", "Sessions not pinned because the worker's session pin budget was full."),
        ("partial_retains", "Session chains only a leading part of which fit the pin budget (that part pinned)."),
        ("ended_demoted", "Blocks of ended sessions demoted from L1 at once."),
        ("group_retains", "Prefixes shared by forked sessions (sub-agents) kept in L1 on their parent's worker."),
    )

    def __init__(self, counts: RetentionCounts) -> None:
        self.counts = counts

    def collect(self):
        for name, doc in self._FIELDS:
            yield CounterMetricFamily(f"kvmesh_session_{name}", doc, value=getattr(self.counts, name))
