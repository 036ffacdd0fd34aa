"""Backoff: doubling from first_s, capped at max_s, jitter within [1 - j, 1] of the base, reset."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvmesh.retry import Backoff


def test_doubles_up_to_the_cap_and_starts_over_after_a_reset() -> None:
    b = Backoff(0.1, 1.0)
    assert [round(b.next(), 6) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    b.reset()
    assert b.next() == 0.1


@given(st.floats(1e-3, 10.0), st.floats(1.0, 100.0), st.floats(0.0, 1.0), st.integers(0, 10_000),
       st.integers(0, 2**32))
def test_every_wait_lies_within_the_jittered_base(first: float, factor: float, jitter: float, attempt: int,
                                                   seed: int) -> None:
    b = Backoff(first, first * factor, jitter, random.Random(seed))
    base = min(first * factor, first * 2 ** min(attempt, 62))
    assert base * (1 - jitter) - 1e-12 <= b.delay(attempt) <= base + 1e-12


def test_jitter_spreads_clients_that_failed_together() -> None:
    waits = {round(Backoff(1.0, 8.0, 0.5, random.Random(seed)).next(), 9) for seed in range(20)}
    assert len(waits) > 1 and all(0.5 <= w <= 1.0 for w in waits)


def test_a_cap_below_the_first_wait_caps_every_wait() -> None:
    b = Backoff(0.5, 0.2)
    assert [b.next() for _ in range(3)] == [0.2, 0.2, 0.2]


@pytest.mark.parametrize("first,cap,jitter", [(0.0, 1.0, 0.0), (0.1, 0.0, 0.0), (0.1, 1.0, 1.5)])
def test_refuses_settings_that_cannot_back_off(first: float, cap: float, jitter: float) -> None:
    with pytest.raises(ValueError):
        Backoff(first, cap, jitter)
