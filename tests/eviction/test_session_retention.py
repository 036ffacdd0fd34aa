"""The eviction service's session planner: turn outcomes in, Retain / Demote advice out (no bus, no engine)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.session import SessionPolicy
from kvmesh.config import SessionRetentionSettings
from kvmesh.eviction.decisions import Watermarks, plan_demotion
from kvmesh.eviction.messages import Demote, Retain
from kvmesh.eviction.occupancy import OccupancyView
from kvmesh.eviction.sessions import SessionRetention
from kvmesh.protocol.blocks import Tier
from kvmesh.sessions.book import SessionBook
from kvmesh.sessions.events import SessionEvent, TurnOutcome

from .helpers import RETENTION_T0, chain_in
from .helpers import named_block as block

T0 = RETENTION_T0
L1 = 100
RULES = SessionRetentionSettings(pin_horizon_s=120, pin_margin_s=10, pin_fraction=0.4, prefetch_lead_s=5)


def event(session: str, chain: list[bytes], outcome: TurnOutcome, at: float, *, started: float | None = None,
          hint_s: float | None = None, worker: str = "w1", tools: tuple[str, ...] = ()) -> SessionEvent:
    return SessionEvent(tenant="t", tenant_salt="ab" * 16, session_id=session, request_id=f"r-{session}-{at}",
                        outcome=outcome, tools=list(tools), last_hash=chain[-1].hex() if chain else None,
                        chain_blocks=len(chain), worker=worker, started_at=started, at=at,
                        expected_return_ms=None if hint_s is None else int(hint_s * 1000))


def planner(view: OccupancyView | None = None) -> SessionRetention:
    return SessionRetention(view or OccupancyView(), SessionBook(), RULES, L1)


def test_a_tool_call_pins_the_chain_until_its_return() -> None:
    p = planner()
    chain = chain_in(p.view, "w1", ["sys", "a1", "a2"])
    [cmd] = p.on_event(event("s", chain, TurnOutcome.TOOL_CALLS, T0, hint_s=3.0, tools=("bash",)), T0)
    assert cmd.worker == "w1" and isinstance(cmd.command, Retain) and not cmd.command.fetch
    assert [bytes.fromhex(h) for h in cmd.command.hashes] == chain  # found from the last block by parent links
    assert cmd.command.until == T0 + 3.0 + RULES.pin_margin_s
    assert cmd.command.tenant_salt == "ab" * 16
    assert p.pinned_blocks("w1", T0 + 1) == 3


def test_an_answer_is_not_pinned_but_prefetched_before_its_return() -> None:
    p = planner()
    chain = chain_in(p.view, "w1", ["sys", "b1"])
    assert p.on_event(event("s", chain, TurnOutcome.ANSWER, T0, hint_s=600.0), T0) == []
    assert p.tick(T0 + 600 - RULES.prefetch_lead_s - 1) == []
    [cmd] = p.tick(T0 + 600 - RULES.prefetch_lead_s)
    assert isinstance(cmd.command, Retain) and cmd.command.fetch and cmd.command.until == T0 + 600 + RULES.pin_margin_s
    assert p.tick(T0 + 600) == [] and p.counts.prefetches == 1
    # The session never came back: once its pin lapses the prefetch counts as wasted.
    p.tick(T0 + 600 + RULES.pin_margin_s + 1)
    assert p.counts.wasted_prefetches == 1


def test_a_session_back_before_its_prefetch_counts_late_and_teaches_the_predictor() -> None:
    p = planner()
    chain = chain_in(p.view, "w1", ["sys", "c1"])
    p.on_event(event("s", chain, TurnOutcome.ANSWER, T0, hint_s=600.0), T0)
    longer = chain_in(p.view, "w1", ["sys", "c1", "c2"])
    p.on_event(event("s", longer, TurnOutcome.ANSWER, T0 + 40, started=T0 + 30), T0 + 40)
    assert p.counts.late_prefetches == 1
    assert p.counts.errors and p.counts.errors[0] != 0.0  # predicted 600 s, came back after 30 s


def test_an_ended_session_demotes_only_its_unshared_l1_blocks_leaves_first() -> None:
    p = planner()
    mine = chain_in(p.view, "w1", ["sys", "d1", "d2"])
    theirs = chain_in(p.view, "w1", ["sys", "e1"])
    p.on_event(event("other", theirs, TurnOutcome.TOOL_CALLS, T0, hint_s=2.0), T0)
    p.on_event(event("s", mine, TurnOutcome.ANSWER, T0, hint_s=600.0), T0)
    [cmd] = p.on_event(event("s", [], TurnOutcome.ENDED, T0 + 1), T0 + 1)  # an explicit end names no chain
    assert isinstance(cmd.command, Demote) and cmd.command.src is Tier.L1
    assert [bytes.fromhex(h) for h in cmd.command.hashes] == [mine[2], mine[1]]  # "sys" is shared: it stays
    assert ("t", "s") not in p.sessions and p.claims.get(block("sys")) == 1


def test_a_granted_pin_holds_its_room_until_it_lapses() -> None:
    p = planner()  # budget: 40 of 100 blocks
    late = chain_in(p.view, "w1", [f"late{i}" for i in range(40)])
    soon = chain_in(p.view, "w1", [f"soon{i}" for i in range(30)])
    [first] = p.on_event(event("late", late, TurnOutcome.TOOL_CALLS, T0, hint_s=20.0), T0)
    # A worker's pin cannot be taken back, so a session back sooner does not take its room: refused now,
    # planned as a prefetch before its return instead.
    assert p.on_event(event("soon", soon, TurnOutcome.TOOL_CALLS, T0, hint_s=2.0), T0) == []
    assert p.counts.budget_refusals == 1 and p.pinned_blocks("w1", T0) == 40
    assert p.sessions[("t", "soon")].prefetch_at is not None
    # Once the first pin has lapsed on the worker, the second session fits.
    after = first.command.until + 1
    again = p.on_event(event("soon", soon, TurnOutcome.TOOL_CALLS, after, hint_s=2.0), after)
    assert len(again) == 1 and isinstance(again[0].command, Retain) and p.pinned_blocks("w1", after) == 30


def test_a_shared_system_prompt_counts_once_in_the_budget() -> None:
    p = planner()  # budget: 40 blocks
    system = [f"sys{i}" for i in range(30)]
    for name in ("a", "b", "c"):
        chain = chain_in(p.view, "w1", [*system, f"{name}1", f"{name}2", f"{name}3"])
        assert p.on_event(event(name, chain, TurnOutcome.TOOL_CALLS, T0, hint_s=2.0), T0)
    assert p.pinned_blocks("w1", T0) == 39 and p.counts.budget_refusals == 0


def test_the_advisor_ranks_by_the_planners_book() -> None:
    p = planner()
    policy = SessionPolicy(book=p.book)  # what the service wires when its policy is session-aware
    tool = chain_in(p.view, "w1", ["t1", "t2"])
    idle = chain_in(p.view, "w1", ["i1", "i2"])
    p.on_event(event("idle", idle, TurnOutcome.ANSWER, T0, hint_s=3600.0), T0)
    p.on_event(event("tool", tool, TurnOutcome.TOOL_CALLS, T0, hint_s=2.0), T0)
    victims = plan_demotion(p.view.blocks("w1", Tier.L1), 4, Watermarks(0.5, 0.5), policy, T0 + 1, lambda h: False)
    assert victims == [idle[1], idle[0]]  # the session back in an hour leaves L1, leaf first; the tool call stays


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 30), st.sampled_from(list(TurnOutcome)),
                          st.floats(0.5, 1000.0), st.sampled_from(["w1", "w2"])), min_size=1, max_size=40))
def test_session_pins_never_exceed_the_budget(turns) -> None:
    p = planner()
    now = T0
    for k, (session, length, outcome, hint, worker) in enumerate(turns):
        now += 1.0
        chain = chain_in(p.view, worker, [f"s{session}-{i}" for i in range(length)])
        p.on_event(event(f"s{session}", chain, outcome, now, started=now - 0.5, hint_s=hint, worker=worker), now)
        p.tick(now)
        for w in ("w1", "w2"):
            assert p.pinned_blocks(w, now) <= p.pin_budget(w)
        assert all(n > 0 for n in p.claims.values())


def started(session: str, request_id: str, at: float, chain: list[bytes] | None = None) -> SessionEvent:
    """The ingress admitted `request_id`, a turn of `session` (it names the prompt's last block, not yet known)."""
    return SessionEvent(tenant="t", tenant_salt="ab" * 16, session_id=session, request_id=request_id,
                        outcome=TurnOutcome.STARTED, last_hash=block("new-tail").hex(), chain_blocks=9,
                        started_at=at, at=at)


def test_an_admitted_turn_is_in_use_and_held_ahead_of_sessions_away() -> None:
    p = SessionRetention(OccupancyView(), SessionBook(), RULES.model_copy(update={"in_use_hold_s": 30.0}), L1)
    a = chain_in(p.view, "w1", [f"a{i}" for i in range(30)])
    b = chain_in(p.view, "w1", [f"b{i}" for i in range(30)])
    p.on_event(event("b", b, TurnOutcome.TOOL_CALLS, T0, hint_s=5.0, tools=("bash",)), T0)  # pinned: back soon
    p.on_event(event("a", a, TurnOutcome.ANSWER, T0, hint_s=600.0), T0)  # away for long: not pinned
    assert not p.in_turn("t", "a")
    # Its next turn is admitted long before any worker takes the job: in use from then on, and held.
    [hold] = p.on_event(started("a", "r-a-2", T0 + 30), T0 + 30)
    assert isinstance(hold.command, Retain) and [bytes.fromhex(h) for h in hold.command.hashes] == a
    assert hold.command.until == T0 + 30 + p.settings.in_use_hold_s
    assert p.in_turn("t", "a")
    assert p.book.next_use(a[0], T0) == T0 + 30  # in use since admission, however long its queue
    # Its end event closes the turn without counting a second start.
    p.on_event(event("a", a, TurnOutcome.TOOL_CALLS, T0 + 90, started=T0 + 30, tools=("bash",)).model_copy(
        update={"request_id": "r-a-2"}), T0 + 90)
    assert not p.in_turn("t", "a")


def test_a_start_delivered_after_its_own_end_is_ignored() -> None:
    p = planner()
    a = chain_in(p.view, "w1", ["s0", "s1"])
    end = event("a", a, TurnOutcome.TOOL_CALLS, T0 + 5, started=T0, tools=("bash",))
    p.on_event(end, T0 + 5)
    assert p.on_event(started("a", end.request_id, T0), T0 + 6) == []
    assert not p.in_turn("t", "a")


def test_an_away_session_is_pinned_only_in_the_room_beside_an_admitted_turn() -> None:
    p = planner()  # budget: 40 blocks of w1's L1; admitted turns are not pinned (in_use_hold_s 0)
    busy = chain_in(p.view, "w1", [f"q{i}" for i in range(30)])
    away = chain_in(p.view, "w1", [f"t{i}" for i in range(20)])
    p.on_event(event("q", busy, TurnOutcome.ANSWER, T0, hint_s=600.0), T0)  # away: not pinned
    assert p.on_event(started("q", "r-q-2", T0 + 1), T0 + 1) == []  # admitted: its prefill needs its 30 blocks
    # A tool call that fits the budget alone (20 <= 40) but not beside the admitted turn (50 > 40):
    # its leading 10 blocks are pinned, not the room the admitted prefill needs.
    [part] = p.on_event(event("t", away, TurnOutcome.TOOL_CALLS, T0 + 2, hint_s=3.0, tools=("bash",)), T0 + 2)
    assert [bytes.fromhex(h) for h in part.command.hashes] == away[:10]
    assert p.counts.partial_retains == 1 and p.counts.budget_refusals == 0
    # Once that turn has ended, the same call is pinned whole.
    p.on_event(event("q", busy, TurnOutcome.ANSWER, T0 + 3, hint_s=600.0).model_copy(
        update={"request_id": "r-q-2"}), T0 + 3)
    [cmd] = p.on_event(event("t", away, TurnOutcome.TOOL_CALLS, T0 + 4, hint_s=3.0, tools=("bash",)), T0 + 4)
    assert isinstance(cmd.command, Retain)


def test_a_pin_fits_the_budget_even_where_the_largest_next_prompt_would_not_fit_beside_it() -> None:
    """The worker yields idle pins to a prefill that does not fit (tests/engine/test_pin_pressure.py), so the
    planner does not hold back room for it: that refused nearly every pin at a small L1."""
    p = planner()  # L1 100, pin budget 40
    big = chain_in(p.view, "w1", [f"big{i}" for i in range(70)])
    small = chain_in(p.view, "w1", [f"small{i}" for i in range(20)])
    p.on_event(event("big", big, TurnOutcome.ANSWER, T0, hint_s=600.0), T0)  # away, not pinned
    [cmd] = p.on_event(event("small", small, TurnOutcome.TOOL_CALLS, T0 + 1, hint_s=2.0, tools=("bash",)), T0 + 1)
    assert isinstance(cmd.command, Retain) and p.counts.budget_refusals == 0
    # The budget still binds: of a second chain, only the 20 leading blocks that fit are pinned; a third,
    # with no room left, is refused.
    more = chain_in(p.view, "w1", [f"more{i}" for i in range(25)])
    [part] = p.on_event(event("more", more, TurnOutcome.TOOL_CALLS, T0 + 2, hint_s=2.0, tools=("bash",)), T0 + 2)
    assert [bytes.fromhex(h) for h in part.command.hashes] == more[:20] and p.counts.partial_retains == 1
    last = chain_in(p.view, "w1", [f"last{i}" for i in range(5)])
    assert p.on_event(event("last", last, TurnOutcome.TOOL_CALLS, T0 + 3, hint_s=2.0, tools=("bash",)), T0 + 3) == []
    assert p.counts.budget_refusals == 1 and p.pinned_blocks("w1", T0 + 3) == 40

def test_the_budget_is_a_share_of_each_workers_own_l1() -> None:
    p = planner()  # the service's default L1: 100 blocks, budget 40
    p.view.set_capacity("big", 400, None)  # from big's heartbeat: budget 160
    on_big = chain_in(p.view, "big", [f"b{i}" for i in range(120)])
    on_w1 = chain_in(p.view, "w1", [f"a{i}" for i in range(120)])
    [whole] = p.on_event(event("b", on_big, TurnOutcome.TOOL_CALLS, T0, hint_s=2.0, worker="big"), T0)
    [part] = p.on_event(event("a", on_w1, TurnOutcome.TOOL_CALLS, T0, hint_s=2.0), T0)
    assert len(whole.command.hashes) == 120 and len(part.command.hashes) == 40
    assert (p.pin_budget("big"), p.pin_budget("w1")) == (160, 40)


def test_a_pin_sharing_blocks_with_a_queued_turn_still_fits_the_budget() -> None:
    """A block of a chain being prefilled is no free room for a pin: pins sharing a system prompt with a
    queued turn stay within the budget (they once reached 60 of 40 blocks)."""
    p = planner()  # budget: 40 blocks
    other = chain_in(p.view, "w1", [f"o{i}" for i in range(30)])
    p.on_event(event("o", other, TurnOutcome.TOOL_CALLS, T0, hint_s=5.0, tools=("bash",)), T0)  # 30 pinned
    system = [f"sys{i}" for i in range(30)]
    queued = chain_in(p.view, "w1", [*system, "q"])
    p.on_event(event("q", queued, TurnOutcome.ANSWER, T0, hint_s=600.0), T0)
    p.on_event(started("q", "r-q-2", T0 + 1), T0 + 1)  # admitted: its 31 blocks are being prefilled
    back = chain_in(p.view, "w1", [*system, "b"])
    # the system prompt it shares with the queued turn takes no room the prefills need, but pins' room it does
    [part] = p.on_event(event("b", back, TurnOutcome.TOOL_CALLS, T0 + 2, hint_s=5.0, tools=("bash",)), T0 + 2)
    assert [bytes.fromhex(h) for h in part.command.hashes] == back[:10]
    assert p.pinned_blocks("w1", T0 + 2) == p.pin_budget("w1") == 40
