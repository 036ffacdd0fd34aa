"""A turn's end is stamped when its answer is decoded: the gap learnt is the tool's run, and a
report ahead of the stamp never moves other sessions' clocks into the future."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.session import SessionPolicy
from kvmesh.sessions.events import TurnOutcome
from kvmesh.sessions.predict import ReturnPredictor
from kvmesh.sim.replay import DEFAULT_DECODE_TOKENS_PER_S, ReplayOptions, replay
from kvmesh.sim.trace import Trace, parse_line

TOOL = TurnOutcome.TOOL_CALLS


def tool_loop(turns: int, output_tokens: int, tool_s: float, rate: float) -> Trace:
    """One session: each turn decodes ``output_tokens`` at ``rate``, then its tool runs ``tool_s``."""
    rows, t, chain = [], 0.0, []
    for k in range(turns):
        chain = chain + [1000 * k + 1, 1000 * k + 2]
        rows.append({"timestamp": round(1000 * t), "input_length": 512 * len(chain), "output_length": output_tokens,
                     "hash_ids": chain, "session_id": "s", "tool_calls": ["bash"]})
        t += output_tokens / rate + tool_s
    return Trace("loop", tuple(parse_line(json.dumps(r)) for r in rows))


@settings(max_examples=25, deadline=None)
@given(output_tokens=st.integers(10, 2000), tool_s=st.floats(0.2, 20.0))
def test_the_gap_learnt_is_the_tool_run_not_the_decode(output_tokens: int, tool_s: float) -> None:
    """With the decode rate the trace was stamped at, the session is expected back one tool run after its end."""
    rate = DEFAULT_DECODE_TOKENS_PER_S
    trace = tool_loop(8, output_tokens, tool_s, rate)
    policy = SessionPolicy()
    replay(trace, policy, capacity=64, options=ReplayOptions(decode_tokens_per_s=rate))
    outlook = policy.book.outlook("s")
    last = trace.requests[-1]
    assert outlook is not None
    assert abs(outlook.ended_at - (last.time_s + output_tokens / rate)) < 1e-9
    learnt = policy.book.predictor._classes["tools:bash"].sorted()  # the class's window of observed gaps
    assert len(learnt) == 7 and all(abs(g - tool_s) < 0.01 for g in learnt)  # ms timestamps round by < 1 ms


def test_without_a_decode_rate_the_turn_ends_at_arrival() -> None:
    trace = tool_loop(5, 500, 2.0, DEFAULT_DECODE_TOKENS_PER_S)
    policy = SessionPolicy()
    replay(trace, policy, capacity=64, options=ReplayOptions(decode_tokens_per_s=0.0))
    outlook = policy.book.outlook("s")
    assert outlook is not None and outlook.ended_at == trace.requests[-1].time_s
    learnt = policy.book.predictor._classes["tools:bash"].sorted()
    assert all(abs(g - 12.0) < 0.01 for g in learnt)  # decode (10 s) + tool (2 s)


@settings(max_examples=40, deadline=None)
@given(ahead_s=st.floats(60.0, 5000.0), back_s=st.floats(0.1, 25.0))
def test_an_end_reported_ahead_of_its_stamp_matures_nothing_early(ahead_s: float, back_s: float) -> None:
    """A's tool turn (prior deadline 30 s: matures at 60 s) comes back at ``back_s``; B's answer, stamped
    past A's maturity but reported at 1 s, must not count A as gone. By the clock A returned: (1+1)/(1+2)."""
    p = ReturnPredictor()
    p.turn_ended("a", 0.0, TOOL, ("bash",))
    p.turn_ended("b", 1.0 + ahead_s, TurnOutcome.ANSWER, now=1.0)
    p.turn_started("a", 1.0 + back_s)
    p.advance(10_000.0)
    assert p.p_return("tool_calls:first") == 2 / 3
