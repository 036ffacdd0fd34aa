"""A circuit breaker so an unreachable tier costs nothing per request.

Closed: calls pass; `failure_threshold` consecutive failures open it. Open:
`allow()` is False (callers fail fast and recompute) until `reset_after_s`
passes, then one caller at a time may probe (half-open). A successful probe
closes it; a failed one reopens it for another `reset_after_s`. Nothing else
is needed to recover: the next caller after the timeout is the probe. A probe
that reports neither (its call raised something the caller does not count)
lapses after `reset_after_s`, and the next caller probes instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int = 3
    reset_after_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _state: BreakerState = BreakerState.CLOSED
    _failures: int = 0
    _opened_at: float = 0.0
    _probing: bool = False
    _probe_at: float = 0.0
    opens: int = 0  # how many times it opened (a metric)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._state is BreakerState.OPEN and self.clock() - self._opened_at >= self.reset_after_s:
                return BreakerState.HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """Whether a call may go out now; in half-open only one probe at a time."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self.clock() - self._opened_at >= self.reset_after_s:
                self._state = BreakerState.HALF_OPEN
                self._probing = False
            if self._state is BreakerState.HALF_OPEN and (
                    not self._probing or self.clock() - self._probe_at >= self.reset_after_s):
                self._probing, self._probe_at = True, self.clock()
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._probing = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
                if self._state is not BreakerState.OPEN:
                    self.opens += 1
                self._state = BreakerState.OPEN
                self._opened_at = self.clock()
                self._probing = False
