"""Forked sessions at the ingress: the parent of a session that names none, inferred from its first prompt.

A sub-agent forked from an agent's context starts with that context: its
first prompt runs through the parent's own turns (its answers, the tool
results it got, the next instructions) before the sub-agent's own task.
Two unrelated sessions of a tenant share less: a system prompt and tool
list, which lie inside every session's first prompt. Hence the rule:

    A session's first turn seen here, when it names no parent, is a fork of
    the session S that first sent the deepest of its prompt's full blocks
    (among sessions this process knows and that have not ended), if that
    shared leading run reaches at least `MIN_OWN_BLOCKS` blocks' worth of
    tokens past the end of S's first prompt.

The tokens past S's first prompt are S's own conversation; sharing a whole
block of them is not a coincidence at any block size kvmesh runs (16-512
tokens). What every session shares sits in each one's first prompt, so it
never suffices, however long it is. The rule errs towards no parent:

- only a session's first turn is examined (an inferred parent is kept);
- a session first seen mid-conversation (served by another replica until
  now, or before a restart) counts its whole context as its first prompt
  here, so it is less likely to be taken for a parent, never more;
- the first sender of a block is its writer (a child sends its parent's
  blocks after the parent did), so a fork of a fork finds the session whose
  turns it shares, not an older sibling; a candidate that fails the rule is
  skipped and the walk goes on at shallower blocks (another session may
  have written those).

A wrong parent moves only advice: where retention keeps a shared prefix and
which worker is the group's home. No token depends on it.

The index: per tenant, block hash -> the first session that sent it, over
the chains of finished turns (the prompt and the answer as the next prompt
quotes it), `max_blocks` per tenant (least recently indexed forgotten
first). A turn indexes only the blocks past those its session indexed last
when its chain extends them, so the work grows with the new tokens; a
lookup walks the new session's prompt blocks once, deepest first. Per
process, like the continuation table (shared/ingress/sessions/table.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.ingress.sessions.table import SessionRecord, SessionTable
from kvmesh.lru import BoundedLRU

MIN_OWN_BLOCKS = 1  # blocks' worth of the other session's own tokens (past its first prompt) a fork shares
MAX_BLOCKS_PER_TENANT = 1 << 15  # about 170 bytes each


class ForkIndex:
    """See the module docstring. Not thread-safe: the ingress's event loop owns it."""

    def __init__(self, block_size: int, max_blocks: int = MAX_BLOCKS_PER_TENANT) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks
        self._tenants: dict[str, BoundedLRU[bytes, str]] = {}  # authenticated tenants: bounded by the key ring

    def index(self, rec: SessionRecord, chain: Sequence[bytes]) -> None:
        """`rec`'s session sent `chain` (full-block hashes, root first): blocks nobody sent before are its own."""
        tenant = rec.ref.tenant
        blocks = self._tenants.get(tenant)
        if blocks is None:
            blocks = self._tenants[tenant] = BoundedLRU(self.max_blocks)
        done, tip = rec.indexed
        start = done if 0 < done <= len(chain) and chain[done - 1] == tip else 0
        for h in chain[start:]:
            if h not in blocks:
                blocks.put(h, rec.ref.client_id)
        rec.indexed = (len(chain), chain[-1]) if chain else (0, b"")

    def parent_of(self, tenant: str, client_id: str, prompt_hashes: Sequence[bytes],
                  table: SessionTable) -> SessionRecord | None:
        """The session `client_id`'s first prompt (`prompt_hashes`, its full blocks) was forked from, by the
        module's rule; None: no session qualifies."""
        blocks = self._tenants.get(tenant)
        if blocks is None:
            return None
        skipped = {client_id}
        for depth in range(len(prompt_hashes), 0, -1):
            holder = blocks.get(prompt_hashes[depth - 1])
            if holder is None or holder in skipped:
                continue
            rec = table.get(tenant, holder)
            if rec is not None and not rec.ended and rec.first_tokens is not None \
                    and depth * self.block_size - rec.first_tokens >= MIN_OWN_BLOCKS * self.block_size:
                return rec
            skipped.add(holder)
        return None
