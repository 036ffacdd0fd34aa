"""Whether the server's inferred sessions can be trusted: do they come back, and do their turns continue them?

Where the client names no session, the server infers one from the prompt's
chain (shared/sessions/inference.py). That guess is worth ranking blocks by
only if it describes the traffic, which two shares measure, over the
inferred sessions' recent turns:

- **returning**: the turn continued a session seen before, rather than
  starting one. SWE-agent trace without its ids: 92%; Mooncake's trace: 36%.
- **resent**: of the blocks the session sent before, the share this turn
  sends again. An agent's context grows by appending (about 96%); where
  inference merges unrelated prompts that share a system prompt into one
  session, each "turn" drops most of the others' blocks, and the session
  order would evict them first.

Both are exponentially decayed, so they follow the traffic as it changes.
The returning share starts below the line: inferred sessions are trusted
once they have shown it (a few dozen turns of agent traffic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_RETURNING = 0.6
MIN_RESENT = 0.8


@dataclass(slots=True)
class DecayedShare:
    hits: float
    total: float
    decay: float = 0.995  # per observation: about the last 200 count

    def add(self, hits: float, total: float = 1.0) -> None:
        self.hits = self.hits * self.decay + hits
        self.total = self.total * self.decay + total

    @property
    def share(self) -> float:
        return self.hits / self.total if self.total > 0 else 0.0


@dataclass(slots=True)
class InferenceTrust:
    returning: DecayedShare = field(default_factory=lambda: DecayedShare(5.0, 10.0))
    resent: DecayedShare = field(default_factory=lambda: DecayedShare(9.0, 10.0))

    def turn(self, continued: bool) -> None:
        self.returning.add(1.0 if continued else 0.0)

    def sent_again(self, kept: int, before: int) -> None:
        if before:
            self.resent.add(kept / before)  # one observation per turn, whatever its size

    @property
    def trusted(self) -> bool:
        return self.returning.share >= MIN_RETURNING and self.resent.share >= MIN_RESENT
