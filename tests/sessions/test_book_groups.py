"""Forked sessions in the session book: a prefix a sub-agent shares with its parent is kept for the parent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.policy_cache import BlockSpec, PolicyCache
from kvmesh.cache_policy.session import SessionPolicy
from kvmesh.sessions.book import BookConfig, SessionBook
from kvmesh.sessions.events import TurnOutcome

TOOL, ANSWER, ENDED = TurnOutcome.TOOL_CALLS, TurnOutcome.ANSWER, TurnOutcome.ENDED
PREFIX = [b"parent/0", b"parent/1", b"parent/2"]
OWN = [b"child/0", b"child/1"]


def fork(book: SessionBook, linked: bool) -> None:
    """The parent calls a sub-agent (a tool call that lasts as long as the child runs); the child sends
    the parent's prefix and its own blocks, then gives its answer back."""
    book.turn_started("parent", PREFIX, 0.0)
    book.turn_ended("parent", 1.0, TOOL, ("task",))
    if linked:
        book.link("child", "parent")
    book.turn_started("child", PREFIX + OWN, 1.0)
    book.turn_ended("child", 2.0, ANSWER)


def test_the_shared_prefix_is_needed_when_the_parent_is_back_not_when_the_child_is() -> None:
    linked, alone = SessionBook(), SessionBook()
    fork(linked, linked=True)
    fork(alone, linked=False)
    parent_back = linked.outlook("parent").next_use()
    child_back = linked.outlook("child").next_use()
    assert parent_back < child_back  # a tool call's return against an answer's
    assert linked.next_use(PREFIX[0], 2.0) == parent_back
    assert alone.next_use(PREFIX[0], 2.0) == child_back  # unlinked: the prefix follows the child alone
    assert linked.next_use(OWN[0], 2.0) == child_back  # the child's own blocks are the child's alone
    assert linked.session_of(PREFIX[0]) == "child" and set(linked.blocks_of("parent")) == set(PREFIX)


def test_the_prefix_survives_pressure_only_for_a_linked_group() -> None:
    def kept(linked: bool) -> bool:
        policy = SessionPolicy()
        book, cache = policy.book, PolicyCache(policy, 12)
        book.turn_started("parent", PREFIX, 0.0)
        cache.insert([BlockSpec(h) for h in PREFIX], 0.0)
        book.turn_ended("parent", 1.0, TOOL, ("task",))
        if linked:
            book.link("child", "parent")
        book.turn_started("child", PREFIX + OWN, 1.0)
        cache.insert([BlockSpec(h) for h in PREFIX + OWN], 1.0)
        book.turn_ended("child", 2.0, ANSWER)
        cache.rekey(book.take_changed(), 2.0)
        for k in range(3):  # sessions in tool calls (back before the child's answer is read), then a new one
            chain = [f"tool{k}/{i}".encode() for i in range(2)]
            book.turn_started(f"tool{k}", chain, 2.0 + k)
            cache.insert([BlockSpec(h) for h in chain], 2.0 + k)
            book.turn_ended(f"tool{k}", 2.0 + k, TOOL, ("bash",))
            cache.rekey(book.take_changed(), 2.0 + k)
        busy = [f"busy/{i}".encode() for i in range(4)]
        book.turn_started("busy", busy, 6.0)
        cache.insert([BlockSpec(h) for h in busy], 6.0)
        return all(h in cache for h in PREFIX)

    assert kept(linked=True)
    assert not kept(linked=False)


def test_the_parents_return_takes_the_prefix_back_and_the_child_keeps_it() -> None:
    book = SessionBook()
    fork(book, linked=True)
    book.turn_started("parent", PREFIX + [b"parent/3"], 3.0)
    assert book.session_of(PREFIX[0]) == "parent"
    assert PREFIX[0] in book.blocks_of("child")
    book.turn_ended("child", 3.5, ENDED)  # the child is done: the prefix stays the parent's
    book.turn_ended("parent", 4.0, TOOL, ("bash",))
    assert book.next_use(PREFIX[0], 4.0) == book.outlook("parent").next_use()


def test_a_block_a_member_stops_sending_stays_with_the_one_that_still_sends_it() -> None:
    book = SessionBook()
    fork(book, linked=True)
    book.turn_started("child", [b"child/rewritten"], 3.0)  # the child's context no longer has the prefix
    book.turn_ended("child", 3.0, TOOL, ("bash",))
    assert book.session_of(PREFIX[0]) == "parent"
    assert book.next_use(PREFIX[0], 3.0) == book.outlook("parent").next_use()
    book.turn_started("parent", [b"parent/other"], 4.0)  # and now nobody sends it: a shared block's prior
    assert book.session_of(PREFIX[0]) is None
    assert book.next_use(PREFIX[0], 4.0) == book.predictor.prior(4.0).next_use()


def test_unrelated_sessions_do_not_keep_each_others_blocks() -> None:
    book = SessionBook()
    book.turn_started("a", PREFIX, 0.0)
    book.turn_ended("a", 1.0, TOOL, ("bash",))
    book.turn_started("b", PREFIX + OWN, 1.0)
    book.turn_ended("b", 2.0, ANSWER)
    assert book.blocks_of("a") == [] and book.session_of(PREFIX[0]) == "b"


def test_a_link_that_would_close_a_cycle_is_ignored() -> None:
    book = SessionBook()
    book.link("b", "a")
    book.link("c", "b")
    book.link("a", "c")  # would make a its own ancestor
    book.link("a", "a")
    book.turn_started("a", PREFIX, 0.0)
    book.turn_started("c", PREFIX, 1.0)
    assert PREFIX[0] in book.blocks_of("a")  # c is in a's group (a is its root): a keeps the block


ops = st.lists(st.one_of(
    st.tuples(st.just("turn"), st.integers(0, 4), st.lists(st.integers(0, 7), max_size=5)),
    st.tuples(st.just("end"), st.integers(0, 4), st.sampled_from([TOOL, ANSWER, ENDED])),
    st.tuples(st.just("link"), st.integers(0, 4), st.integers(0, 4)),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops, max_blocks=st.integers(2, 10))
def test_holders_and_blocks_agree(ops: list[tuple], max_blocks: int) -> None:
    """Whatever the order of turns, ends and links: a block's owner and keepers hold it, and every block a
    session holds names it as owner or keeper. Without links the book ranks as if groups did not exist."""
    book = SessionBook(config=BookConfig(max_blocks=max_blocks))
    alone = SessionBook(config=BookConfig(max_blocks=max_blocks))  # the same events, no links
    t = 0.0
    for op in ops:
        t += 1.0
        if op[0] == "turn":
            chain = [f"b{i}".encode() for i in op[2]]
            for b in (book, alone):
                b.turn_started(f"s{op[1]}", chain, t)
        elif op[0] == "end":
            for b in (book, alone):
                b.turn_ended(f"s{op[1]}", t, op[2], ("bash",) if op[2] is TOOL else ())
        else:
            book.link(f"s{op[1]}", f"s{op[2]}")
    blocks = book._blocks  # noqa: SLF001 - the invariant is about the book's own tables
    for h, b in blocks.items():
        for holder in (b.session, *b.keepers):
            s = book._sessions.get(holder)  # noqa: SLF001
            assert s is None or h in s.blocks
        assert b.session not in b.keepers and len(set(b.keepers)) == len(b.keepers)
    for sid in book._sessions:  # noqa: SLF001
        for h in book.blocks_of(sid):
            b = blocks.get(h)
            assert b is not None and sid in (b.session, *b.keepers)
    if not any(op[0] == "link" for op in ops):
        assert {h: book.next_use(h, t) for h in blocks} == {h: alone.next_use(h, t) for h in blocks}
