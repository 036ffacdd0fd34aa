"""Prometheus collectors of the eviction service, in the service's own registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass(frozen=True, slots=True)
class EvictionMetrics:
    commands: Counter  # label kind: demote | warm
    l3_deleted: Counter  # label reason: expired | over_quota | over_capacity | damaged

    @classmethod
    def create(cls, registry: CollectorRegistry, pins: Callable[[], float], workers: Callable[[], float],
               l3_objects: Callable[[], float]) -> EvictionMetrics:
        for name, doc, fn in (
            ("kvmesh_eviction_pins", "Block hashes pinned now.", pins),
            ("kvmesh_eviction_workers", "Workers whose occupancy the service tracks.", workers),
            ("kvmesh_eviction_l3_objects", "L3 chunk objects the latest scan left.", l3_objects),
        ):
            Gauge(name, doc, registry=registry).set_function(fn)
        return cls(
            commands=Counter("kvmesh_eviction_commands", "Commands sent to workers.", ("kind",), registry=registry),
            l3_deleted=Counter("kvmesh_eviction_l3_deleted", "L3 objects deleted by GC.", ("reason",),
                               registry=registry),
        )
