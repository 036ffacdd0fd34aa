"""Forked sessions at the ingress: the parent a request names or the chain implies, and the group's root.

The real tracker, table, fork index and hasher on token ids (no bus: the
published events are checked on the stack, tests/ingress/test_sessions.py).
"""

from __future__ import annotations

from kvmesh.config import EngineSettings
from kvmesh.ingress.admission.admit import Admitted
from kvmesh.ingress.admission.auth import Principal
from kvmesh.ingress.core.metrics import IngressMetrics
from kvmesh.ingress.sessions.forks import ForkIndex
from kvmesh.ingress.sessions.table import SessionTable
from kvmesh.ingress.sessions.tracker import ChainHasher, SessionTracker
from kvmesh.ingress.sessions.turn import SessionInputs, Turn
from kvmesh.sessions.events import TurnOutcome
from kvmesh.sessions.identity import SessionHints, Source, scoped_session_id
from kvmesh.sessions.lineage import ParentRef, ParentSource
from kvmesh.sessions.outcome import ToolEvidence
from prometheus_client import CollectorRegistry

BLOCK = EngineSettings().block_size
SYSTEM = list(range(1000, 1000 + 2 * BLOCK))  # two full blocks every session of the tenant starts with
PRINCIPAL = Principal("k", "t", "00")


def tracker(registry: CollectorRegistry | None = None, forks: ForkIndex | None = None) -> SessionTracker:
    metrics = IngressMetrics.create(registry or CollectorRegistry())
    return SessionTracker(SessionTable(BLOCK), ChainHasher(BLOCK, "fp"), metrics, None, forks)


def turn(tr: SessionTracker, request: int, prompt: list[int], session: str | None = None,
         parent: str | None = None) -> Turn:
    explicit = None if session is None else (Source.HEADER, session)
    named = None if parent is None else ParentRef(parent, ParentSource.HEADER)
    adm = Admitted(None, PRINCIPAL, {}, f"req_{request}", None)  # type: ignore[arg-type]
    return tr.begin(adm, SessionInputs(explicit, SessionHints(), named), prompt, ToolEvidence())


def served(tr: SessionTracker, t: Turn, answer: list[int]) -> list[int]:
    """Finish `t` with `answer` (quoted as is by the next prompt); returns the next prompt's start."""
    tr.finish(t, [*answer, 2], answer, "stop", "prefill-0")
    return [*t.prompt_ids, *answer]


def words(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 900 + 3000 for i in range(n)]


# --- named parents -------------------------------------------------------------

def test_a_named_parent_is_remembered_and_the_group_shares_its_roots_id() -> None:
    tr = tracker()
    lead = turn(tr, 1, SYSTEM + words(1, 5), session="lead")
    served(tr, lead, words(2, 5))
    sub = turn(tr, 2, SYSTEM + words(3, 5), session="sub-1", parent="lead")
    assert sub.parent == ParentRef("lead", ParentSource.HEADER)
    assert sub.parent_session_id == scoped_session_id("t", "lead")
    assert sub.group_session_id == lead.session_id != sub.session_id  # routing keys the group by its root
    nxt = served(tr, sub, words(4, 5))
    # its later turns keep the parent without naming it; a sub-agent of the sub-agent has the same root
    again = turn(tr, 3, nxt + words(5, 3), session="sub-1")
    assert again.parent == sub.parent and again.group_session_id == lead.session_id
    served(tr, again, words(6, 2))
    deeper = turn(tr, 4, SYSTEM + words(7, 5), session="sub-1a", parent="sub-1")
    assert deeper.parent_session_id == scoped_session_id("t", "sub-1") and deeper.group_session_id == lead.session_id
    # a session is never its own parent; a root is its own group
    assert turn(tr, 5, SYSTEM, session="solo", parent="solo").parent is None
    assert lead.parent is None and lead.group_session_id == lead.session_id


async def test_the_end_event_names_the_parent() -> None:
    tr = tracker()
    sub = turn(tr, 1, SYSTEM + words(1, 4), session="sub", parent="lead")
    served(tr, sub, words(2, 4))
    ended = await tr.end("t", "00", "sub")
    assert ended.outcome is TurnOutcome.ENDED and ended.parent_session_id == scoped_session_id("t", "lead")


# --- inferred parents ----------------------------------------------------------

def lead_with_two_turns(tr: SessionTracker) -> tuple[list[int], list[int]]:
    """An inferred session `auto-1`: (its first prompt, its history after the first answer)."""
    first = SYSTEM + words(1, BLOCK + 3)  # its first prompt: 3 full blocks and 3 tokens
    lead = turn(tr, 1, first)
    history = served(tr, lead, words(2, 2 * BLOCK))
    second = turn(tr, 2, history + words(3, BLOCK))
    assert second.ref.client_id == "auto-1"  # it continued
    served(tr, second, words(4, 4))
    return first, history


def test_a_new_session_forked_from_anothers_own_turns_gets_it_as_parent() -> None:
    registry = CollectorRegistry()
    tr = tracker(registry)
    first, history = lead_with_two_turns(tr)
    # branching after the lead's first answer (not its last turn): a new session, forked from the lead
    fork = turn(tr, 3, history + words(9, 5))
    assert fork.ref.source is Source.NEW
    assert fork.parent == ParentRef("auto-1", ParentSource.INFERRED) and fork.group_session_id == scoped_session_id(
        "t", "auto-1")
    assert registry.get_sample_value("kvmesh_ingress_session_parents_total", {"source": "inferred"}) == 1
    # what every session shares (the system prompt, or even the lead's whole first prompt) is not enough
    assert turn(tr, 4, SYSTEM + words(8, 3 * BLOCK)).parent is None
    assert turn(tr, 5, first + words(8, 3 * BLOCK)).parent is None
    # nor is less than a block's worth of the lead's own tokens (here 13 of them, past its first prompt)
    assert turn(tr, 6, first + history[len(first):len(first) + 13] + words(8, 3 * BLOCK)).parent is None


def test_inference_names_the_writer_of_the_shared_turns_and_skips_ended_and_self() -> None:
    tr = tracker()
    _, history = lead_with_two_turns(tr)
    fork = turn(tr, 3, history + words(9, 5), session="fork")  # explicit, first seen: inferred too
    assert fork.parent is not None and fork.parent.client_id == "auto-1"
    fork_history = served(tr, fork, words(10, 2 * BLOCK))
    fork_second = turn(tr, 4, fork_history + words(11, 4), session="fork")
    served(tr, fork_second, words(12, 3))
    # a fork of the fork's own turns: the fork wrote them, so it is the parent; the group's root is the lead
    grandchild = turn(tr, 5, fork_history + words(13, 4))
    assert grandchild.parent is not None and grandchild.parent.client_id == "fork"
    assert grandchild.group_session_id == scoped_session_id("t", "auto-1")
    # a fork of the lead's turns is the lead's child even though the fork sent those blocks later
    sibling = turn(tr, 6, history + words(14, 5))
    assert sibling.parent is not None and sibling.parent.client_id == "auto-1"
    # ended sessions are nobody's parent
    tr.table.end("t", "auto-1")
    assert turn(tr, 7, history + words(15, 5)).parent is None


def test_a_session_first_seen_mid_conversation_counts_its_context_as_its_first_prompt() -> None:
    """Served by another replica until now: this process cannot tell its own turns from a system prompt."""
    tr = tracker()
    context = SYSTEM + words(1, 6 * BLOCK)
    late = turn(tr, 1, context, session="late")
    history = served(tr, late, words(2, 2 * BLOCK))
    second = turn(tr, 2, history + words(3, BLOCK), session="late")
    served(tr, second, words(4, 2))
    assert turn(tr, 3, context[:5 * BLOCK] + words(5, 2 * BLOCK)).parent is None  # inside its first prompt
    assert turn(tr, 4, history + words(6, 4)).parent.client_id == "late"  # past it by a whole block


def test_the_fork_index_is_bounded_least_recently_indexed_first() -> None:
    forks = ForkIndex(BLOCK, max_blocks=6)
    tr = tracker(forks=forks)
    lead = turn(tr, 1, SYSTEM + words(1, 2 * BLOCK))
    history = served(tr, lead, words(2, 2 * BLOCK))
    rec = tr.table.get("t", "auto-1")
    assert rec is not None and rec.indexed == (6, tr.hasher.extend([], history, "00")[-1])
    assert turn(tr, 2, history + words(3, 2), session="fork-1").parent.client_id == "auto-1"
    # a session with 8 blocks of its own pushes the lead out
    other = turn(tr, 3, words(4, 8 * BLOCK))
    served(tr, other, [])
    assert len(forks._tenants["t"]) == 6
    assert turn(tr, 4, history + words(5, 2), session="fork-2").parent is None
