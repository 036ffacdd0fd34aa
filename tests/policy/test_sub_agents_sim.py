"""`kvmesh sim` with forked sessions: the trace's parent_session_id links a sub-agent to its parent."""

from __future__ import annotations

import pytest
from kvmesh.sim.replay import ReplayOptions
from kvmesh.sim.run import run_one
from kvmesh.sim.trace import Trace, TraceRequest

PREFIX = [b"p0", b"p1", b"p2"]


def request(t: float, session: str, blocks: list[bytes], tools: tuple[str, ...], parent: str | None = None):
    return TraceRequest(time_s=t, input_length=len(blocks) * 512, output_length=1, blocks=tuple(blocks),
                        session_id=session, tool_calls=tools, parent_session_id=parent)


def fork_trace() -> Trace:
    """A lead calls a sub-agent and waits; the sub-agent answers (to the lead, but an answer reads as a person's
    turn to the book); two sessions in tool calls fill the pool; the lead comes back with its prefix."""
    return Trace("fork", (
        request(0.0, "lead", PREFIX, ("task",)),
        request(1.0, "sub", PREFIX + [b"s0"], (), parent="lead"),
        request(2.0, "x", [b"x0", b"x1"], ("bash",)),
        request(3.0, "y", [b"y0", b"y1"], ("bash",)),
        request(4.0, "lead", PREFIX + [b"p3"], ("bash",)),
    ))


@pytest.mark.parametrize("policy", ["default", "session"])
def test_the_lead_finds_its_prefix_only_when_the_group_is_linked(policy: str) -> None:
    linked = run_one(fork_trace(), policy, 5, ReplayOptions(decode_tokens_per_s=0.0))
    alone = run_one(fork_trace(), policy, 5, ReplayOptions(decode_tokens_per_s=0.0, groups=False))
    lru = run_one(fork_trace(), "lru", 5, ReplayOptions(decode_tokens_per_s=0.0))
    assert linked.hit_blocks == 6  # the sub-agent's 3 shared blocks, then the lead's 3 again
    assert alone.hit_blocks == lru.hit_blocks == 4  # the lead lost its prefix's tail
