"""A bounded table's get-or-create: the entry for a key, made if absent, marked most recently used."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def lru_entry(table: OrderedDict[K, V], key: K, make: Callable[[], V], capacity: int) -> V:
    """`table[key]` (created by `make()` when absent), now the most recent; past `capacity` the least recent goes."""
    value = table.get(key)
    if value is None:
        value = table[key] = make()
        if len(table) > capacity:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return value
