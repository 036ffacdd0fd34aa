"""Prometheus collectors of a cache-index replica (on the service's own registry, `kvmesh_index_*`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


@dataclass(slots=True)
class IndexMetrics:
    dumps: Counter  # label result: ok | failed
    purges: Counter
    lookup_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry, blocks: Callable[[], float], gaps: Callable[[], float],
               stream_seq: Callable[[], float]) -> IndexMetrics:
        for name, doc, fn in (
            ("kvmesh_index_blocks", "Blocks with at least one (worker, tier) or L3 entry.", blocks),
            ("kvmesh_index_gaps", "Workers whose event sequence has a gap awaiting a state dump.", gaps),
            ("kvmesh_index_stream_seq", "KV_EVENTS sequence of the last batch applied.", stream_seq),
        ):
            Gauge(name, doc, registry=registry).set_function(fn)
        return cls(
            dumps=Counter("kvmesh_index_dumps", "State dumps fetched to repair a gap.", ("result",), registry=registry),
            purges=Counter("kvmesh_index_purges", "Workers purged after their heartbeat lapsed.", registry=registry),
            lookup_seconds=Histogram("kvmesh_index_lookup_seconds", "In-process lookup time.",
                                     buckets=_LOOKUP_BUCKETS, registry=registry),
        )
