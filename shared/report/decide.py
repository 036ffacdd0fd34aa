"""The recommendation: the issue's three rules, each a list of checks on the measured numbers.

- hosted fits volatile load (peak/mean QPS at or above a threshold), latency-tolerant traffic (no TTFT
  SLO, or one the hosted APIs meet) and small volume (requests/day below a threshold);
- self_built fits stable load, volume beyond about a million requests a day (where batching wins
  3-5x throughput) and a lower cost per 1M tokens than the cheapest hosted API;
- kvmesh_cross_turn fits sessions averaging more than 5 turns, several instances that share a cache
  (workers at or above a count, with a share of hits from peers or L3), and a strict hit-rate need.

A rule's score is the share of its checks that hold; the highest score wins, a tie goes to the option
that is cheaper per 1M tokens. `reasons` are the winner's checks, each with its input and threshold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvmesh.report.measure import Measured
from kvmesh.report.prices import Rules

OPTIONS = ("hosted", "self_built", "kvmesh_cross_turn")


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    value: float | None  # the measured input (None: not given)
    op: str  # how value compares to threshold when the check holds
    threshold: float | None
    holds: bool

    def reason(self) -> str:
        value = "not given" if self.value is None else f"{self.value:,.4g}"
        limit = "" if self.threshold is None else f" {self.op} {self.threshold:,.4g}"
        return f"{self.name}: {value}{limit} -> {'yes' if self.holds else 'no'}"


@dataclass(frozen=True, slots=True)
class Rule:
    option: str
    checks: tuple[Check, ...]

    @property
    def score(self) -> float:
        return sum(c.holds for c in self.checks) / len(self.checks)


@dataclass(frozen=True, slots=True)
class Inputs:
    """What the rules read besides the measured records: the operator's needs and the costs per 1M tokens."""

    ttft_slo_ms: float | None = None
    hit_rate_target: float | None = None
    cost_per_1m: dict[str, float] | None = None  # option -> USD per 1M tokens (hosted: the cheapest API)


@dataclass(frozen=True, slots=True)
class Decision:
    recommendation: str
    reasons: tuple[str, ...]
    rules: tuple[Rule, ...]

    def to_json(self) -> dict:
        return {
            "recommendation": self.recommendation,
            "reasons": list(self.reasons),
            "rules": [{"option": r.option, "score": r.score, "checks": [asdict(c) for c in r.checks]}
                      for r in self.rules],
        }


def cross_instance_share(m: Measured) -> float:
    """Share of cached tokens that came from another worker or from L3 (a cache the fleet shares)."""
    shared = m.tier_tokens.get("peer", 0) + m.tier_tokens.get("l3", 0)
    return shared / m.cached_tokens if m.cached_tokens else 0.0


def rules(m: Measured, t: Rules, inp: Inputs) -> tuple[Rule, ...]:
    ratio, per_day = m.load.peak_to_mean, m.load.requests_per_day
    costs = inp.cost_per_1m or {}
    slo = inp.ttft_slo_ms
    hosted = Rule("hosted", (
        Check("volatile load (peak/mean QPS)", ratio, ">=", t.volatile_peak_to_mean, ratio >= t.volatile_peak_to_mean),
        Check("latency-tolerant (TTFT SLO, ms)", slo, ">=", t.hosted_ttft_ms, slo is None or slo >= t.hosted_ttft_ms),
        Check("small volume (requests/day)", per_day, "<", t.small_volume_requests_per_day,
              per_day < t.small_volume_requests_per_day),
    ))
    self_cost, hosted_cost = costs.get("self_built"), costs.get("hosted")
    self_built = Rule("self_built", (
        Check("stable load (peak/mean QPS)", ratio, "<", t.volatile_peak_to_mean, ratio < t.volatile_peak_to_mean),
        Check("volume (requests/day)", per_day, ">=", t.self_built_requests_per_day,
              per_day >= t.self_built_requests_per_day),
        Check("cheaper than the cheapest hosted API (USD per 1M tokens)", self_cost, "<", hosted_cost,
              self_cost is not None and hosted_cost is not None and self_cost < hosted_cost),
    ))
    share = cross_instance_share(m)
    target = inp.hit_rate_target
    cross = Rule("kvmesh_cross_turn", (
        Check("turns per session (mean)", m.turns.mean, ">", t.session_turns, m.turns.mean > t.session_turns),
        Check("instances sharing a cache (workers)", m.workers, ">=", t.shared_instances,
              m.workers >= t.shared_instances and share >= t.cross_instance_hit_share),
        Check("strict hit-rate need (target; measured "f"{m.hit_rate:.1%})", target, "given", None,
              target is not None),
    ))
    return hosted, self_built, cross


def decide(m: Measured, t: Rules, inp: Inputs) -> Decision:
    """Evaluate the rules and pick the option with the highest score (a tie: the cheaper per 1M tokens)."""
    evaluated = rules(m, t, inp)
    costs = inp.cost_per_1m or {}
    best = max(evaluated, key=lambda r: (r.score, -costs.get(r.option, float("inf"))))
    reasons = [f"{best.option} fits {sum(c.holds for c in best.checks)} of {len(best.checks)} checks"]
    reasons += [c.reason() for c in best.checks]
    if best.option == "kvmesh_cross_turn" and m.workers >= t.shared_instances:
        reasons.append(f"cached tokens from peers or L3: {cross_instance_share(m):.1%} "
                       f"(needs {t.cross_instance_hit_share:.0%} to count as sharing)")
    if best.option in costs:
        reasons.append(f"cost per 1M tokens: ${costs[best.option]:.4f}")
    return Decision(best.option, tuple(reasons), evaluated)
