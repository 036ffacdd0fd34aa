"""Forked sessions in the retention planner: a group keeps the prefix it shares while any member is active.

The planner on a real occupancy view and session book (no bus): the
parent's chain sits on one worker, its sub-agent's on the same or another.
Each check that needs the link is run without it too, where the old
behaviour shows.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.config import SessionRetentionSettings
from kvmesh.eviction.messages import Demote, Retain, WorkerCommand
from kvmesh.eviction.occupancy import OccupancyView
from kvmesh.eviction.session_groups import MAX_DEPTH, MAX_MEMBERS, SessionGroups
from kvmesh.eviction.sessions import SessionRetention
from kvmesh.sessions.book import SessionBook
from kvmesh.sessions.events import SessionEvent, TurnOutcome

from .helpers import RETENTION_T0, chain_in
from .helpers import named_block as block

T0 = RETENTION_T0
L1 = 100
RULES = SessionRetentionSettings(pin_horizon_s=120, pin_margin_s=10, pin_fraction=0.4, prefetch_lead_s=5)
SHARED = ["sys0", "sys1", "sys2", "lead1", "lead2"]  # the lead's context up to the fork


def event(session: str, chain: list[bytes], outcome: TurnOutcome, at: float, *, hint_s: float | None = None,
          worker: str = "w1", parent: str | None = None, request: str = "") -> SessionEvent:
    return SessionEvent(tenant="t", tenant_salt="ab" * 16, session_id=session,
                        request_id=request or f"r-{session}-{at}", outcome=outcome,
                        tools=["task"] if outcome is TurnOutcome.TOOL_CALLS else [],
                        last_hash=chain[-1].hex() if chain else None, chain_blocks=len(chain), worker=worker,
                        started_at=at - 1, at=at, parent_session_id=parent,
                        expected_return_ms=None if hint_s is None else int(hint_s * 1000))


def started(session: str, request: str, at: float, prompt_blocks: int, parent: str | None) -> SessionEvent:
    """A turn admitted: it names the prompt's last block, which no worker has stored yet."""
    return SessionEvent(tenant="t", tenant_salt="ab" * 16, session_id=session, request_id=request,
                        outcome=TurnOutcome.STARTED, last_hash=block(f"{session}-new-tail").hex(),
                        chain_blocks=prompt_blocks, started_at=at, at=at, parent_session_id=parent)


def planner() -> SessionRetention:
    return SessionRetention(OccupancyView(), SessionBook(), RULES, L1)


def retains(cmds: list[WorkerCommand], worker: str) -> list[list[bytes]]:
    return [[bytes.fromhex(h) for h in c.command.hashes] for c in cmds
            if c.worker == worker and isinstance(c.command, Retain)]


def test_a_sub_agent_in_a_tool_call_keeps_the_shared_prefix_on_its_idle_parents_worker() -> None:
    for linked in (True, False):
        p = planner()
        lead = chain_in(p.view, "w1", [*SHARED, "lead3", "lead4"])
        sub = chain_in(p.view, "w2", [*SHARED, "sub1", "sub2"])  # routed elsewhere (the home was overloaded)
        assert p.on_event(event("lead", lead, TurnOutcome.ANSWER, T0, hint_s=600.0), T0) == []  # away: no pin
        cmds = p.on_event(event("sub", sub, TurnOutcome.TOOL_CALLS, T0 + 1, hint_s=3.0, worker="w2",
                                parent="lead" if linked else None), T0 + 1)
        assert retains(cmds, "w2") == [sub]  # its own chain, where it ran
        if linked:  # and the part it shares with the lead stays where the lead (and its other sub-agents) go
            [group] = [c for c in cmds if c.worker == "w1"]
            assert retains([group], "w1") == [lead[:len(SHARED)]]
            assert group.command.until == T0 + 1 + 3.0 + RULES.pin_margin_s  # as long as the sub-agent's pin
            assert p.counts.group_retains == 1 and p.pinned_blocks("w1", T0 + 2) == len(SHARED)
        else:
            assert retains(cmds, "w1") == [] and p.pinned_blocks("w1", T0 + 2) == 0


def test_the_advisors_book_ranks_a_shared_prefix_by_the_member_back_first() -> None:
    """The lead waits on its sub-agent (a tool call); the sub-agent's answer goes to a person. What they
    share is needed when the lead is back, which is what the advisor's demotions rank by."""
    for linked in (True, False):
        p = planner()
        lead = chain_in(p.view, "w1", [*SHARED, "lead3"])
        sub = chain_in(p.view, "w1", [*SHARED, "sub1"])
        p.on_event(event("lead", lead, TurnOutcome.TOOL_CALLS, T0, hint_s=30.0), T0)
        p.on_event(event("sub", sub, TurnOutcome.ANSWER, T0 + 1, hint_s=600.0,
                         parent="lead" if linked else None), T0 + 1)
        lead_back = p.book.outlook("t\x1flead").next_use()
        sub_back = p.book.outlook("t\x1fsub").next_use()
        assert lead_back < sub_back
        assert p.book.next_use(sub[0], T0 + 1) == (lead_back if linked else sub_back)


def test_an_ended_parent_spares_what_its_running_sub_agent_shares() -> None:
    for linked in (True, False):
        p = planner()
        lead = chain_in(p.view, "w1", [*SHARED, "lead3", "lead4", "lead5"])
        p.on_event(event("lead", lead, TurnOutcome.TOOL_CALLS, T0, hint_s=300.0), T0)  # waits for its sub-agent
        # the sub-agent's first turn is admitted: its prompt (6 blocks) is the lead's context and a task
        admitted = p.on_event(started("sub", "r-sub-1", T0 + 1, 6, "lead" if linked else None), T0 + 1)
        ended = p.on_event(event("lead", [], TurnOutcome.ENDED, T0 + 2), T0 + 2)
        [demote] = ended
        assert isinstance(demote.command, Demote)
        demoted = [bytes.fromhex(h) for h in demote.command.hashes]
        if linked:
            # Its chain is not known yet: it shares at most its prompt's 6 blocks, kept pinned and not demoted.
            assert retains(admitted, "w1") == [lead[:6]]
            assert admitted[0].command.until == T0 + 1 + RULES.pin_horizon_s
            assert demoted == [lead[7], lead[6]]
            # once its turn ends the exact run is known, and its own pin keeps it
            sub = chain_in(p.view, "w1", [*SHARED, "sub1"])
            [own] = p.on_event(event("sub", sub, TurnOutcome.TOOL_CALLS, T0 + 5, hint_s=2.0, parent="lead",
                                     request="r-sub-1"), T0 + 5)
            assert retains([own], "w1") == [sub]
        else:
            assert admitted == [] and demoted == lead[::-1]  # the old behaviour: the whole lead goes first


def test_a_sub_agents_own_pin_on_the_parents_worker_is_not_repeated() -> None:
    p = planner()
    lead = chain_in(p.view, "w1", [*SHARED, "lead3"])
    sub = chain_in(p.view, "w1", [*SHARED, "sub1"])
    p.on_event(event("lead", lead, TurnOutcome.ANSWER, T0, hint_s=600.0), T0)
    cmds = p.on_event(event("sub", sub, TurnOutcome.TOOL_CALLS, T0 + 1, hint_s=3.0, parent="lead"), T0 + 1)
    assert retains(cmds, "w1") == [sub] and p.counts.group_retains == 0  # its pin holds the shared run already


def test_a_sub_agents_prefetch_brings_the_shared_prefix_back_to_the_parents_worker() -> None:
    p = planner()
    lead = chain_in(p.view, "w1", [*SHARED, "lead3"])
    sub = chain_in(p.view, "w2", [*SHARED, "sub1"])
    p.on_event(event("lead", lead, TurnOutcome.ANSWER, T0, hint_s=3600.0), T0)
    assert p.on_event(event("sub", sub, TurnOutcome.ANSWER, T0, hint_s=600.0, worker="w2", parent="lead"), T0) == []
    cmds = p.tick(T0 + 600 - RULES.prefetch_lead_s)
    assert retains(cmds, "w2") == [sub] and retains(cmds, "w1") == [lead[:len(SHARED)]]
    assert all(c.command.fetch for c in cmds)


def test_group_pins_stay_within_the_budget() -> None:
    p = planner()  # budget: 40 blocks of w1's L1
    lead = chain_in(p.view, "w1", [*(f"ctx{i}" for i in range(30)), "lead-tail"])
    other = chain_in(p.view, "w1", [f"o{i}" for i in range(25)])
    p.on_event(event("other", other, TurnOutcome.TOOL_CALLS, T0, hint_s=3.0), T0)  # 25 pinned
    p.on_event(event("lead", lead, TurnOutcome.ANSWER, T0, hint_s=600.0), T0)
    sub = chain_in(p.view, "w2", [*(f"ctx{i}" for i in range(30)), "sub1"])
    cmds = p.on_event(event("sub", sub, TurnOutcome.TOOL_CALLS, T0 + 1, hint_s=3.0, worker="w2", parent="lead"),
                      T0 + 1)
    assert retains(cmds, "w1") == [lead[:15]]  # the leading 15 of the 30 shared blocks fit beside the 25
    assert p.counts.partial_retains == 1 and p.pinned_blocks("w1", T0 + 2) == 40


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7), st.integers(1, 30), st.sampled_from(list(TurnOutcome)),
                          st.floats(0.5, 1000.0), st.sampled_from(["w1", "w2"])), min_size=1, max_size=40))
def test_pins_with_groups_never_exceed_the_budget(turns) -> None:
    p = planner()
    now = T0
    for session, parent, length, outcome, hint, worker in turns:
        now += 1.0
        # a child's chain starts with its parent's context: forks share a leading run
        names = [f"ctx{i}" for i in range(min(parent, session) * 3)] + [f"s{session}-{i}" for i in range(length)]
        chain = chain_in(p.view, worker, names)
        link = f"s{parent}" if parent != session else None
        if outcome is TurnOutcome.STARTED:
            p.on_event(started(f"s{session}", f"r{now}", now, len(chain), link), now)
        else:
            p.on_event(event(f"s{session}", chain, outcome, now, hint_s=hint, worker=worker, parent=link), now)
        p.tick(now)
        for w in ("w1", "w2"):
            assert p.pinned_blocks(w, now) <= p.pin_budget(w)
        assert all(n > 0 for n in p.claims.values())
        assert set(p.groups.parent) <= set(p.sessions)  # links go with their sessions


def test_groups_are_bounded_and_acyclic() -> None:
    g = SessionGroups()
    a, b, c = ("t", "a"), ("t", "b"), ("t", "c")
    g.link(b, a)
    g.link(c, b)
    g.link(a, c)  # would close a cycle: refused
    assert g.root(c) == a and a not in g.parent
    g.forget(b)  # b's children keep their link: c is still in a's group through the dangling b
    assert g.root(c) == b and g.members(c) == [b, c]
    chain = [("t", f"n{i}") for i in range(2 * MAX_DEPTH)]
    for child, parent in zip(chain[1:], chain):
        g.link(child, parent)
    assert g.root(chain[-1]) == chain[-1 - MAX_DEPTH]  # at most MAX_DEPTH links up
    for i in range(2 * MAX_MEMBERS):
        g.link(("t", f"kid{i}"), a)
    assert len(g.members(a)) == MAX_MEMBERS
    for i in range(2 * MAX_MEMBERS):
        g.forget(("t", f"kid{i}"))
    assert a not in g.children
