"""ReturnPredictor: priors, per-tool and per-session learning, hints, return odds, conditioning, bounds."""

from __future__ import annotations

import math
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.sessions.events import TurnOutcome
from kvmesh.sessions.predict import PRIOR_GAP_S, PredictorConfig, ReturnPredictor
from kvmesh.sessions.quantiles import RecentQuantiles

TOOL, ANSWER, ENDED = TurnOutcome.TOOL_CALLS, TurnOutcome.ANSWER, TurnOutcome.ENDED


def loop(p: ReturnPredictor, session: str, gaps: list[float], tool: str, t: float = 0.0) -> float:
    """A session that calls ``tool`` after every turn and comes back after each of ``gaps``."""
    p.turn_started(session, t)
    for g in gaps:
        p.turn_ended(session, t, TOOL, [tool])
        t += g
        p.turn_started(session, t)
    return t


def test_priors_before_anything_is_seen() -> None:
    p = ReturnPredictor()
    assert p.expected_return("nobody") is None
    p.turn_started("a", 0.0)
    p.turn_ended("a", 0.0, TOOL, ["bash"])
    p.turn_started("b", 0.0)
    p.turn_ended("b", 0.0, ANSWER)
    assert p.expected_return("a") == PRIOR_GAP_S[TOOL]
    assert p.expected_return("b") == PRIOR_GAP_S[ANSWER]
    assert p.expected_return("a") < p.outlook("a").deadline  # the pin's quantile lies beyond the median


def test_each_tool_learns_its_own_latency_and_errors_are_signed() -> None:
    p = ReturnPredictor()
    loop(p, "s1", [2.0] * 10, "edit")
    loop(p, "s2", [30.0] * 10, "test")
    p.turn_ended("s3", 100.0, TOOL, ["edit"])
    p.turn_ended("s4", 100.0, TOOL, ["test"])
    assert p.expected_return("s3") == 102.0 and p.expected_return("s4") == 130.0
    assert p.turn_started("s3", 105.0) == 3.0  # came back 3 s later than predicted
    assert p.turn_started("s4", 120.0) == -10.0  # 10 s early
    p.turn_ended("s5", 200.0, TOOL, ["never-seen"])  # unknown tool: the tool-call fallback (all tool gaps)
    assert 200.0 + 2.0 <= p.expected_return("s5") <= 200.0 + 30.0


def test_a_slow_session_is_predicted_slower_than_its_class() -> None:
    p = ReturnPredictor(PredictorConfig(bias_prior=1.0))
    for k in range(8):
        loop(p, f"fast{k}", [4.0] * 4, "bash", t=10.0 * k)
    loop(p, "slow", [12.0] * 6, "bash", t=0.0)
    p.turn_ended("slow", 1000.0, TOOL, ["bash"])
    p.turn_ended("new", 1000.0, TOOL, ["bash"])
    assert p.expected_return("new") - 1000.0 < p.expected_return("slow") - 1000.0 <= 12.0 + 1e-9


def test_hint_overrides_and_ended_is_never() -> None:
    p = ReturnPredictor()
    loop(p, "s", [3.0] * 5, "bash")
    p.turn_ended("s", 50.0, TOOL, ["bash"], hint_s=40.0)
    assert p.expected_return("s") == 90.0
    p.turn_ended("s", 60.0, ENDED)
    assert p.expected_return("s") == math.inf
    assert p.turn_started("s", 70.0) is None  # no prediction to be wrong about
    p.forget("s")
    assert p.outlook("s") is None


def test_return_odds_are_learned_per_class() -> None:
    """One-shot questions never come back; a chat that came back once mostly does again."""
    p = ReturnPredictor(PredictorConfig(window=16))
    t = 0.0
    for k in range(40):
        p.turn_started(f"one-shot{k}", t)
        p.turn_ended(f"one-shot{k}", t, ANSWER)
        t += 1.0
    for k in range(40):
        s = f"chat{k}"
        p.turn_started(s, t)
        p.turn_ended(s, t, ANSWER)
        for _ in range(9):
            t += 20.0
            p.turn_started(s, t)
            p.turn_ended(s, t, ANSWER)
    p.advance(t + 10_000.0)
    # first answers: 40 of 80 came back; later ones: 8 of each chat's 9
    assert math.isclose(p.p_return("answer:first"), 41 / 82)
    assert math.isclose(p.p_return("answer:later"), (320 + 1) / (360 + 2))


def test_an_idle_heavy_tailed_session_drifts_away_and_a_steady_tool_draws_near() -> None:
    p, q = ReturnPredictor(), ReturnPredictor()
    loop(p, "people", [5.0, 10.0, 40.0, 80.0, 300.0, 900.0, 20.0, 60.0], "think")
    loop(q, "tool", [9.0, 10.0, 10.0, 11.0, 10.0, 9.5, 10.5, 10.0], "build")
    p.turn_ended("people", 0.0, TOOL, ["think"])
    q.turn_ended("tool", 0.0, TOOL, ["build"])
    people, tool = p.outlook("people"), q.outlook("tool")
    # people: the longer away, the later expected (remaining time grows)
    assert people.given_absent(70.0).next_use() - 70.0 > people.next_use() - 0.0
    # a steady tool: 9.9 s in, it is due any moment
    assert tool.given_absent(9.9).next_use() - 9.9 < tool.next_use() - 0.0
    assert tool.given_absent(60.0).p_return < tool.p_return  # long overdue: less likely to come back at all
    assert tool.checkpoints() == sorted(tool.checkpoints()) and max(tool.gaps) in tool.checkpoints()
    gone = tool.checkpoints()[-1]  # twice the longest gap: taken for gone, its blocks go first
    assert tool.given_absent(gone).next_use() == math.inf > tool.given_absent(gone - 1.0).next_use()


def test_state_is_bounded() -> None:
    p = ReturnPredictor(PredictorConfig(max_sessions=10, max_classes=4))
    for k in range(100):
        p.turn_started(f"s{k}", float(k))
        p.turn_ended(f"s{k}", float(k), TOOL, [f"tool{k}"])
        p.turn_started(f"s{k}", k + 1.0)
    assert len(p._sessions) == 10 and len(p._classes) == 4
    assert p.outlook("s0") is None


@settings(max_examples=80, deadline=None)
@given(xs=st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=200), window=st.integers(1, 64),
       q=st.floats(0.0, 1.0))
def test_recent_quantiles_is_exact_on_its_window(xs: list[float], window: int, q: float) -> None:
    sketch = RecentQuantiles(window)
    for x in xs:
        sketch.add(x)
    recent = xs[-window:]
    assert len(sketch) == len(recent)
    assert min(recent) <= sketch.quantile(q) <= max(recent)
    assert sketch.quantile(0.0) == min(recent) and sketch.quantile(1.0) == max(recent)
    assert math.isclose(sketch.quantile(0.5), statistics.median(recent), rel_tol=1e-9, abs_tol=1e-9)
    assert sketch.quantile(min(q + 0.1, 1.0)) >= sketch.quantile(q)
