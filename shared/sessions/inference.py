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

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_MAX_ENDS = 1 << 17


@dataclass(slots=True)
class SessionInference:
    """``assign(full_blocks)`` -> (session id, whether it continues an earlier one)."""

    max_ends: int = DEFAULT_MAX_ENDS
    prefix: str = "inferred-"
    _ends: OrderedDict[bytes, str] = field(default_factory=OrderedDict)
    _next: int = 0

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
        self._ends.pop(chain_end, None)
        self._ends[chain_end] = session
        if len(self._ends) > self.max_ends:
            self._ends.popitem(last=False)
