"""BoundedLRU against a reference model: a list of keys in use order and a dict of values."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvmesh.lru import BoundedLRU

KEYS = st.integers(0, 6)
OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), KEYS, st.integers()),
    st.tuples(st.just("use"), KEYS, st.none()),
    st.tuples(st.just("get"), KEYS, st.none()),
    st.tuples(st.just("entry"), KEYS, st.integers()),
    st.tuples(st.just("pop"), KEYS, st.none()),
), max_size=60)


@given(st.integers(1, 5), OPS)
def test_matches_a_model_of_use_order(capacity: int, ops: list) -> None:
    lru: BoundedLRU[int, int] = BoundedLRU(capacity)
    order: list[int] = []
    values: dict[int, int] = {}

    def mark(key: int) -> None:
        if key in order:
            order.remove(key)
        order.append(key)

    for op, key, value in ops:
        if op == "put":
            mark(key)
            values[key] = value
            dropped = [(k, values.pop(k)) for k in order[: max(0, len(order) - capacity)]]
            del order[: len(dropped)]
            assert lru.put(key, value) == dropped
        elif op == "use":
            if key in values:
                mark(key)
            assert lru.use(key) == values.get(key)
        elif op == "get":
            assert lru.get(key) == values.get(key)
        elif op == "entry":
            if key not in values:
                values[key] = value
                mark(key)
                if len(order) > capacity:
                    values.pop(order.pop(0))
            else:
                mark(key)
            assert lru.entry(key, lambda v=value: v) == values[key]
        else:
            if key in values:
                order.remove(key)
            assert lru.pop(key) == values.pop(key, None)
        assert list(lru) == order
        assert dict(lru.items()) == values
        assert len(lru) <= capacity


def test_get_and_in_do_not_keep_an_entry_alive() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1 and "a" in lru
    assert lru.put("c", 3) == [("a", 1)]
    assert lru.use("b") == 2
    assert lru.put("d", 4) == [("c", 3)]


def test_capacity_must_hold_one_entry() -> None:
    with pytest.raises(ValueError):
        BoundedLRU(0)
