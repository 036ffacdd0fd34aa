"""Policies by name: what configs, the CLI and the simulator refer to."""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.cache_policy.base import EvictionPolicy, LRUPolicy
from kvmesh.cache_policy.continuum import ContinuumPolicy
from kvmesh.cache_policy.cost import CostPolicy
from kvmesh.cache_policy.lfu import LFUPolicy
from kvmesh.cache_policy.session import SessionPolicy
from kvmesh.cache_policy.tinylfu import TinyLFUPolicy

DEFAULT_POLICY = "cost"

_FACTORIES: dict[str, Callable[[], EvictionPolicy]] = {
    "cost": CostPolicy,
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "tinylfu": TinyLFUPolicy,
    "session": SessionPolicy,  # needs turn events: its caller feeds policy.book (see session.py)
    "continuum": ContinuumPolicy,
}

POLICIES: tuple[str, ...] = tuple(_FACTORIES)


def get_policy(name: str) -> EvictionPolicy:
    """A fresh policy object (policies with history keep it per object); "default" = cost."""
    key = DEFAULT_POLICY if name == "default" else name
    try:
        return _FACTORIES[key]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}") from None
