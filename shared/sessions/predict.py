"""Return-time prediction: when will a session's next turn arrive, and will it at all?

Learned online from two calls per turn, ``turn_ended`` (how the turn ended:
its outcome and the tools it called) and ``turn_started`` (the next turn's
arrival: the observed gap). The gap after a turn is predicted from:

- its class: the tool signature of a ``tool_calls`` turn (the sorted,
  distinct tool names: one name for most turns), or, for an answer, whether
  it was the session's first turn (a first answer is often a one-shot
  question; a conversation that came back once keeps coming back);
- a fallback per outcome (tools vs answer) while the class has fewer than
  ``min_samples`` gaps, and a physical prior before anything is seen;
- the session's own bias, per outcome: the mean log ratio of its observed
  gaps to the class median, shrunk towards 0 by ``bias_prior``
  pseudo-observations (a slow sandbox says nothing of a slow typist);
- a client hint (``hint_s``), which overrides all of that.

Each class keeps a ``RecentQuantiles`` window of gaps. The point estimate
(``expected_return``) is the median: the error metric is the signed
difference to it, and the median minimises the absolute error of a skewed
distribution. The ``deadline`` is the 0.9 quantile: a TTL pin that lasts
until then outlives 9 in 10 tool runs, while a higher quantile would hold
memory through the long tail of runs that take minutes.

An ``Outlook`` keeps the (scaled) window it was predicted from, so it can be
*conditioned* on the session still being away at a later time: the gaps
already exceeded drop out, the median of the rest is the new estimate and
the return odds fall by Bayes (``Outlook.given_absent``). Heavy-tailed gaps
(people) then push an idle session further away the longer it is idle;
tight ones (a tool with a steady latency) bring it closer until they pass.

``p_return`` is the share of a class's turns (outcome x first/later turn)
that were followed by another turn, counted once each turn matures (at
twice its deadline, at most ``max_wait_s`` after it ended), with a Laplace
prior.
Bounded: sessions and tool classes are LRU-capped. Not thread-safe.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvmesh.lru import BoundedLRU
from kvmesh.sessions.events import TurnOutcome
from kvmesh.sessions.quantiles import RecentQuantiles

# Before any gap is observed: a tool runs for seconds, a person replies in minutes; spread as a
# log-normal of sigma 0.86 (p90 = 3 x median), written as its deciles so the prior is a window too.
PRIOR_GAP_S = {TurnOutcome.TOOL_CALLS: 10.0, TurnOutcome.ANSWER: 120.0}
_PRIOR_SPREAD = tuple(math.exp(0.86 * z) for z in (-1.28, -0.84, -0.52, -0.25, 0.0, 0.25, 0.52, 0.84, 1.28))
_MIN_GAP_S = 0.01  # floor for logs: gaps are never quite zero
CHECKPOINTS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)  # window quantiles at which an idle session is re-estimated
# An idle session twice as old as the longest gap seen is taken for gone. Every finite estimate must
# end at such an event: a frozen absolute time would, once it is past, rank a dead session above live ones.
_EXPIRE_AFTER = 2.0


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    window: int = 64  # gaps kept per class (RecentQuantiles)
    min_samples: int = 3  # a class is trusted from this many gaps; before, the outcome's fallback
    deadline_quantile: float = 0.9
    bias_prior: float = 2.0  # pseudo-observations of "no bias" in a session's bias
    max_sessions: int = 1 << 16
    max_classes: int = 1024
    max_wait_s: float = 3600.0  # a turn not followed by then counts as not returned


@dataclass(frozen=True, slots=True)
class Outlook:
    """What is expected of a session after its latest turn ended (times absolute, seconds).

    ``gaps``: the ascending window of gaps the estimate came from, scaled by
    the session's bias (empty for an ended session); ``as_of``: the time the
    estimate assumes the session is still away (its turn's end, until
    ``given_absent`` moves it).
    """

    ended_at: float
    outcome: TurnOutcome
    expected_at: float  # median estimate of the next turn's arrival (inf: ended)
    deadline: float  # deadline_quantile estimate: most such sessions are back by then
    p_return: float  # probability that another turn comes at all
    gaps: tuple[float, ...] = ()
    as_of: float = -math.inf

    def given_absent(self, now: float) -> Outlook:
        """The outlook knowing the session has not come back by ``now``."""
        n = len(self.gaps)
        if n == 0 or now <= self.ended_at:
            return self
        age = now - self.ended_at
        if age >= _EXPIRE_AFTER * self.gaps[-1]:  # far beyond every gap seen: not expected back
            return replace(self, expected_at=math.inf, p_return=0.0, as_of=now)
        left = n - bisect.bisect_right(self.gaps, age)
        if left:
            share = left / n
            expected = self.ended_at + self.gaps[n - left + (left - 1) // 2]  # median of the gaps not yet passed
        else:  # older than every gap seen: expect it to stay away about as long again
            share = 0.5 / n
            expected = now + age
        p = self.p_return * share / (1.0 - self.p_return + self.p_return * share)
        return replace(self, expected_at=expected, p_return=p, as_of=now)

    def next_use(self, now: float | None = None) -> float:
        """The expected return plus the odds against it times the time still to wait: inf if it never comes.

        ``E + (1/p - 1) * max(E - t, 0)`` at ``t = now`` (default: ``as_of``):
        the time until return stretched by the odds of returning at all, so
        ranking blocks by it ranks them by expected reads per second kept (a
        hazard rate), Belady's "farthest next use" when returns are uncertain.
        It falls towards ``E`` as ``now`` advances; a lazy-heap cache reads it
        as of the latest re-estimate (``now=None``), which the checkpoints renew.
        """
        if self.p_return <= 0.0 or not math.isfinite(self.expected_at):
            return math.inf
        start = max(self.as_of, self.ended_at, -math.inf if now is None else now)
        return self.expected_at + (1.0 / self.p_return - 1.0) * max(self.expected_at - start, 0.0)

    def checkpoints(self) -> list[float]:
        """Times at which ``given_absent`` changes much: the window's quantiles after the turn ended."""
        n = len(self.gaps)
        if n == 0:
            return []
        times = {self.ended_at + self.gaps[round(q * (n - 1))] for q in CHECKPOINTS}
        times.add(self.ended_at + _EXPIRE_AFTER * self.gaps[-1])
        return sorted(times)


@dataclass(slots=True)
class _Session:
    turns: int = 0
    outlook: Outlook | None = None
    gap_class: str = ""  # the class the pending prediction came from
    class_median: float = 0.0  # that class's median gap when predicted (the bias's reference)
    hinted: bool = False
    bias: dict[TurnOutcome, tuple[float, int]] = field(default_factory=dict)  # outcome -> (sum of log ratios, n)


@dataclass(slots=True)
class ReturnPredictor:
    config: PredictorConfig = field(default_factory=PredictorConfig)
    _sessions: BoundedLRU[str, _Session] = field(init=False)
    _classes: BoundedLRU[str, RecentQuantiles] = field(init=False)
    _fallbacks: dict[TurnOutcome, RecentQuantiles] = field(default_factory=dict)
    _returned: dict[str, list[int]] = field(default_factory=dict)  # p-class -> [returned, matured]
    _maturing: list[tuple[float, int, str, int, str]] = field(default_factory=list)
    _seq: int = 0

    def __post_init__(self) -> None:
        self._sessions = BoundedLRU(self.config.max_sessions)
        self._classes = BoundedLRU(self.config.max_classes)

    # -- the interface ------------------------------------------------------

    def turn_ended(self, session_id: str, at: float, outcome: TurnOutcome, tools: Sequence[str] = (),
                   hint_s: float | None = None, now: float | None = None) -> None:
        """Session ``session_id``'s turn ended at ``at`` with ``outcome`` (``tools``: names it called).

        ``now``: the clock, if earlier than ``at`` (the end reported ahead of its stamp): turns are
        counted as not returned only once the clock reaches their maturity, never on a future stamp.
        """
        self._mature(at if now is None else min(now, at))
        s = self._session(session_id)
        s.turns = max(s.turns, 1)
        if outcome is TurnOutcome.ENDED:
            s.outlook = Outlook(at, outcome, math.inf, math.inf, 0.0, (), at)
            return
        gap_class = _gap_class(outcome, tools, s.turns)
        window = self._window(gap_class, outcome)
        q = self.config.deadline_quantile
        median = _quantile(window, 0.5)
        s.gap_class, s.class_median, s.hinted = gap_class, median, hint_s is not None
        p_class = _p_class(outcome, s.turns)
        p = self.p_return(p_class)
        if hint_s is not None:
            gaps: tuple[float, ...] = (max(hint_s, 0.0),)
        else:
            total, n = s.bias.get(outcome, (0.0, 0))
            factor = math.exp(total / (n + self.config.bias_prior))
            gaps = window if factor == 1.0 else tuple(g * factor for g in window)
        s.outlook = Outlook(at, outcome, at + _quantile(gaps, 0.5), at + _quantile(gaps, q), p, gaps, at)
        deadline = s.outlook.deadline
        self._seq += 1
        # twice the deadline: a return after the 0.9 quantile is late, not absent
        matures = at + min(2.0 * max(deadline - at, 0.0), self.config.max_wait_s)
        heapq.heappush(self._maturing, (matures, self._seq, session_id, s.turns, p_class))

    def turn_started(self, session_id: str, at: float) -> float | None:
        """A turn of ``session_id`` arrived at ``at``: learn the gap; returns ``at - expected`` (None: no prediction)."""
        s = self._session(session_id)
        error = None
        o = s.outlook
        if o is not None and o.outcome is not TurnOutcome.ENDED:
            gap = max(at - o.ended_at, 0.0)
            error = at - o.expected_at
            self._class(s.gap_class).add(gap)
            self._fallbacks.setdefault(o.outcome, RecentQuantiles(self.config.window)).add(gap)
            if not s.hinted:
                total, n = s.bias.get(o.outcome, (0.0, 0))
                ratio = math.log(max(gap, _MIN_GAP_S) / max(s.class_median, _MIN_GAP_S))
                s.bias[o.outcome] = (total + ratio, n + 1)
        s.turns += 1
        s.outlook = None
        self._mature(at)  # after counting this turn: a return at the maturity instant is a return
        return error

    def expected_return(self, session_id: str) -> float | None:
        """Absolute time of the expected next turn: inf for an ended session, None if unknown or mid-turn."""
        o = self.outlook(session_id)
        return None if o is None else o.expected_at

    def outlook(self, session_id: str) -> Outlook | None:
        s = self._sessions.get(session_id)
        return None if s is None else s.outlook

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    # -- what the policy also reads -------------------------------------------

    def prior(self, at: float) -> Outlook:
        """The outlook of a session nothing is known of, as if its first answer ended at ``at``."""
        gaps = self._window(_gap_class(TurnOutcome.ANSWER, (), 1), TurnOutcome.ANSWER)
        q = self.config.deadline_quantile
        return Outlook(at, TurnOutcome.ANSWER, at + _quantile(gaps, 0.5), at + _quantile(gaps, q),
                       self.p_return(_p_class(TurnOutcome.ANSWER, 1)), gaps, at)

    def p_return(self, p_class: str) -> float:
        returned, matured = self._returned.get(p_class, (0, 0))
        return (returned + 1) / (matured + 2)

    def advance(self, now: float) -> None:
        """Count the turns that matured by ``now`` (also done by every turn call)."""
        self._mature(now)

    # -- internals ------------------------------------------------------------

    def _session(self, session_id: str) -> _Session:
        return self._sessions.entry(session_id, _Session)

    def _class(self, name: str) -> RecentQuantiles:
        return self._classes.entry(name, lambda: RecentQuantiles(self.config.window))

    def _window(self, gap_class: str, outcome: TurnOutcome) -> tuple[float, ...]:
        """The ascending gaps after turns of ``gap_class``: its own, else its outcome's, else the prior."""
        for sketch in (self._classes.get(gap_class), self._fallbacks.get(outcome)):
            if sketch is not None and len(sketch) >= self.config.min_samples:
                return sketch.sorted()
        return tuple(PRIOR_GAP_S[outcome] * k for k in _PRIOR_SPREAD)

    def _mature(self, now: float) -> None:
        while self._maturing and self._maturing[0][0] <= now:
            _, _, session_id, turn, p_class = heapq.heappop(self._maturing)
            s = self._sessions.get(session_id)
            counts = self._returned.setdefault(p_class, [0, 0])
            counts[0] += s is not None and s.turns > turn
            counts[1] += 1


def _quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile of the ascending ``xs`` (as ``RecentQuantiles.quantile``)."""
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _gap_class(outcome: TurnOutcome, tools: Sequence[str], turns: int) -> str:
    if outcome is TurnOutcome.TOOL_CALLS:
        return "tools:" + "+".join(sorted(set(tools)))
    return "answer:first" if turns <= 1 else "answer:later"


def _p_class(outcome: TurnOutcome, turns: int) -> str:
    return f"{outcome.value}:{'first' if turns <= 1 else 'later'}"
