"""How long to wait between tries: exponential backoff, capped, with jitter.

`Backoff(first_s, max_s)` waits `first_s`, then doubles up to `max_s` (a `max_s` below `first_s` caps
every wait, as a setting may ask). With `jitter` j each wait is
scaled by a random factor in [1 - j, 1], so clients that failed together (a fleet losing its NATS
server, uploaders losing S3) do not retry in lockstep. Every retry loop in kvmesh takes its waits from
one of these; what counts as retriable and when to give up stays with the loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_MAX_DOUBLINGS = 62  # 2**62 x any positive first_s is past every cap: no overflow for long outages


@dataclass(slots=True)
class Backoff:
    first_s: float
    max_s: float
    jitter: float = 0.0  # 0: exact waits; 0.5: each wait is 50-100% of its base
    rng: random.Random = field(default_factory=random.Random)  # jitter only: nothing else is drawn from it
    attempt: int = 0  # waits handed out since the last reset

    def __post_init__(self) -> None:
        if self.first_s <= 0 or self.max_s <= 0:
            raise ValueError(f"waits must be positive, got first_s={self.first_s} and max_s={self.max_s}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def delay(self, attempt: int) -> float:
        """The wait before retry number `attempt` (0-based), without moving this backoff."""
        base = min(self.max_s, self.first_s * 2 ** min(attempt, _MAX_DOUBLINGS))
        return base * (1 - self.jitter * self.rng.random()) if self.jitter else base

    def next(self) -> float:
        """The next wait: the first after a reset is `first_s` (jittered)."""
        wait = self.delay(self.attempt)
        self.attempt += 1
        return wait

    def reset(self) -> None:
        """A try succeeded: the next failure waits `first_s` again."""
        self.attempt = 0
