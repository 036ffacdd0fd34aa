"""A bounded map that forgets its least recently used entries.

The caches and "seen lately" tables of every service (grammar templates, finished request ids, session
records, chain ends) are one of these: at most `capacity` entries, and writing one past that drops the
entries used least recently. `get` and `in` read without marking an entry used (a lookup that must not
keep an entry alive); `use`, `put` and `entry` mark it used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    __slots__ = ("capacity", "_items")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._items)

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._items.get(key, default)

    def use(self, key: K, default: V | None = None) -> V | None:
        """The value (or `default`), now the most recently used if present."""
        if key not in self._items:
            return default
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Set `key`, now the most recently used; returns the entries dropped to stay within `capacity`."""
        self._items[key] = value
        self._items.move_to_end(key)
        dropped = []
        while len(self._items) > self.capacity:
            dropped.append(self._items.popitem(last=False))
        return dropped

    def entry(self, key: K, make: Callable[[], V]) -> V:
        """The value of `key`, made by `make()` if absent; now the most recently used."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = make()
        self.put(key, value)
        return value

    def pop(self, key: K, default: V | None = None) -> V | None:
        return self._items.pop(key, default)

    def items(self) -> Iterator[tuple[K, V]]:
        """Entries, least recently used first."""
        return iter(self._items.items())

    def values(self) -> Iterator[V]:
        return iter(self._items.values())

    def clear(self) -> None:
        self._items.clear()
