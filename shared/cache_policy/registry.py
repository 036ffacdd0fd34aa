"""Policies by name: what configs, the CLI and the simulator refer to."""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.cache_policy.arc import ARCPolicy
from kvmesh.cache_policy.base import EvictionPolicy, LRUPolicy
from kvmesh.cache_policy.continuum import ContinuumPolicy
from kvmesh.cache_policy.cost import CostPolicy
from kvmesh.cache_policy.default import DefaultPolicy
from kvmesh.cache_policy.lfu import LFUPolicy
from kvmesh.cache_policy.queue_cache import QueuePolicy
from kvmesh.cache_policy.s3fifo import S3FIFOPolicy
from kvmesh.cache_policy.session import SessionPolicy
from kvmesh.cache_policy.tinylfu import TinyLFUPolicy

DEFAULT_POLICY = "default"

_FACTORIES: dict[str, Callable[[], EvictionPolicy]] = {
    "default": DefaultPolicy,  # session-aware, like "session": its caller feeds policy.book (see default.py)
    "cost": CostPolicy,
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "tinylfu": TinyLFUPolicy,
    "session": SessionPolicy,  # needs turn events: its caller feeds policy.book (see session.py)
    "continuum": ContinuumPolicy,
}

POLICIES: tuple[str, ...] = tuple(_FACTORIES)


def get_policy(name: str) -> EvictionPolicy:
    """A fresh policy object (policies with history keep it per object)."""
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}") from None


# Queue-structured references: whole algorithms with their own queues, run by a ``QueueCache``
# (``kvmesh sim``). They are not priority functions, so a pool or a tier cannot be configured with them.
_QUEUE_FACTORIES: dict[str, Callable[[], QueuePolicy]] = {
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
}

QUEUE_POLICIES: tuple[str, ...] = tuple(_QUEUE_FACTORIES)


def get_queue_policy(name: str) -> QueuePolicy:
    """A queue-structured reference policy by name (each cache it runs gets fresh queues)."""
    try:
        return _QUEUE_FACTORIES[name]()
    except KeyError:
        raise ValueError(f"unknown queue policy {name!r}; known: {', '.join(QUEUE_POLICIES)}") from None
