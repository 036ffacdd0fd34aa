"""Sessions inferred from prefix chains, for requests that carry no session id.

A conversation's next turn re-sends the whole previous turn: its chain
extends the previous chain's last full block. So a request continues the
session whose latest chain ended at the deepest block this request contains;
if none did, it starts a new session. Only chain *ends* are remembered, never
inner blocks: two sessions that merely share a system prompt stay apart.
The table (chain end -> session) is LRU-bounded; a forgotten end starts a
new session, which costs a prediction, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.lru import BoundedLRU

DEFAULT_MAX_ENDS = 1 << 17


@dataclass(slots=True)
class SessionInference:
    """``assign(full_blocks)`` -> (session id, whether it continues an earlier one)."""

    max_ends: int = DEFAULT_MAX_ENDS
    prefix: str = "inferred-"
    _ends: BoundedLRU[bytes, str] = field(init=False)
    _next: int = 0

    def __post_init__(self) -> None:
        self._ends = BoundedLRU(self.max_ends)

    def __len__(self) -> int:
        return len(self._ends)

    def assign(self, full_blocks: Sequence[bytes]) -> tuple[str, bool]:
        """The session of a request whose full input blocks are ``full_blocks``, and record its chain end.

        The deepest recorded chain end found in ``full_blocks`` wins (a turn
        extends its own previous turn, which is deeper than any shared prefix).
        """
        session = None
        for h in reversed(full_blocks):
            session = self._ends.get(h)
            if session is not None:
                break
        continued = session is not None
        if session is None:
            session = f"{self.prefix}{self._next}"
            self._next += 1
        if full_blocks:
            self.record(full_blocks[-1], session)
        return session, continued

    def record(self, chain_end: bytes, session: str) -> None:
        """Remember that ``session``'s latest chain ends at ``chain_end`` (also for explicit ids)."""
        self._ends.put(chain_end, session)
