"""Where the GPU savings come from: L1 prefix caching alone, and what kvmesh adds on top of it.

The report prices the same traffic on the same stated GPU model three times,
differing only in the tokens each request found cached (shared/report/self_built.py):
no cache (the reference), the baseline engine's own LRU L1, and kvmesh.
The two steps between them are the savings:

- `l1_prefix_caching` = no cache - self_built: what any engine's own prefix
  cache gives for free (vLLM's or SGLang's automatic prefix caching);
- `kvmesh_on_top` = self_built - kvmesh_cross_turn: what kvmesh's L2/L3
  tiers, cache-aware routing and retention add beyond that. It can be
  negative, when the served fleet hit less than the baseline's L1 would have.

Each step is in prompt tokens not prefilled, prefill GPU-seconds, provisioned
GPU-hours and USD (total, per day, per 1M tokens). Decode is the same in all
three, so each step is a prefill difference.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvmesh.report.self_built import SelfBuiltCost

L1_PREFIX_CACHING = "l1_prefix_caching"
KVMESH_ON_TOP = "kvmesh_on_top"


@dataclass(frozen=True, slots=True)
class Saving:
    source: str
    cached_tokens: int  # more prompt tokens found cached than the step's starting point
    hit_rate: float  # those tokens over all prompt tokens
    prefill_gpu_s: float
    provisioned_gpu_hours: float
    usd: float
    per_day_usd: float
    per_1m_tokens_usd: float

    def to_json(self) -> dict:
        return asdict(self)


def step(source: str, before: SelfBuiltCost, after: SelfBuiltCost, tokens_in: int) -> Saving:
    """What going from `before` to `after` saves (positive: `after` is cheaper)."""
    tokens = after.cached_tokens - before.cached_tokens
    return Saving(
        source, tokens, tokens / tokens_in if tokens_in else 0.0,
        before.prefill_gpu_s - after.prefill_gpu_s,
        before.provisioned_gpu_hours - after.provisioned_gpu_hours,
        before.total_usd - after.total_usd,
        before.per_day_usd - after.per_day_usd,
        before.per_1m_tokens_usd - after.per_1m_tokens_usd,
    )


def savings(no_cache: SelfBuiltCost, self_built: SelfBuiltCost, kvmesh: SelfBuiltCost,
            tokens_in: int) -> tuple[Saving, Saving]:
    """The two steps: the baseline's own L1 over no cache, then kvmesh over the baseline."""
    return (step(L1_PREFIX_CACHING, no_cache, self_built, tokens_in),
            step(KVMESH_ON_TOP, self_built, kvmesh, tokens_in))
