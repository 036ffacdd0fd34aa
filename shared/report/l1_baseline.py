"""The self-built baseline's cache: one engine with LRU prefix caching in its own L1, replayed on the served traffic.

That is what a user who runs vLLM or SGLang without kvmesh already has for
free: automatic prefix caching in the engine's GPU memory, evicting the
least recently used block, and nothing beyond it (no host or object-store
tier, no cache-aware routing, no retention by predicted next use).

The hits come from the sim, not from a replay of our own: the records
become the trace `kvmesh sim` reads (shared/traffic/trace_lines.py) and
run through `run_one(trace, "lru", capacity)`, so the block totals equal
`kvmesh sim --policy lru` on the same recording and capacity. The replay
only reports totals, so its cache is read (a pure lookup) just before each
request to learn that request's hit.

The report models the fleet as one pooled L1 (`capacity_blocks`: the
engine's L1 blocks x workers seen, as for its Belady line), so the baseline
is one engine with that L1. With several workers this is generous to the
baseline: separate engines behind a round-robin router each see a share of
every session and hit less.

Tokens an engine skips: the hit blocks' tokens, but never the prompt's last
token (its logits give the first output token), so at most
`(input_length - 1) // block_tokens` blocks, the rule kvmesh's scheduler
and vLLM's prefix cache both apply.

Its blind spot: a record lists its prompt's blocks, not the blocks its
answer wrote, so the replay never caches those, though an engine that keeps
its generated blocks (vLLM does) may hit them on the next turn. Blocks the
served records hit past every earlier prompt (`seen_blocks`, an infinite
cache's hit) can only be such blocks; `answer_block_tokens` counts them,
so a reader sees how much of what kvmesh adds may be this and not its tiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.protocol.traffic import TrafficRecord
from kvmesh.report.served_trace import as_sim_trace
from kvmesh.sim.replay import ReplayOptions, never_evicting_hits
from kvmesh.sim.run import run_one
from kvmesh.sim.tiers import TieredCache
from kvmesh.sim.trace import TraceRequest

POLICY = "lru"
WHAT = ("one engine with LRU prefix caching in its own L1 of the fleet's pooled L1 capacity "
        "(vLLM/SGLang automatic prefix caching), replayed on the served prompts")


@dataclass(frozen=True, slots=True)
class L1Baseline:
    """What the baseline engine's L1 held of each request's prompt, in arrival order."""

    capacity_blocks: int
    hit_blocks: tuple[int, ...]  # leading prompt blocks found in L1, as the sim counts them
    cached_tokens: tuple[int, ...]  # prompt tokens the engine did not prefill
    seen_blocks: tuple[int, ...]  # leading prompt blocks some earlier prompt held (an infinite cache's hit)
    input_blocks: int
    answer_block_tokens: int  # tokens the served records hit past every earlier prompt (see the module doc)

    @property
    def total_hit_blocks(self) -> int:
        return sum(self.hit_blocks)

    @property
    def total_cached_tokens(self) -> int:
        return sum(self.cached_tokens)

    @property
    def hit_rate(self) -> float:
        """Hit prompt blocks over prompt blocks (the hit-rate curve's unit)."""
        return self.total_hit_blocks / self.input_blocks if self.input_blocks else 0.0

    def to_json(self, tokens_in: int) -> dict:
        return {
            "what": WHAT, "engines": 1, "policy": POLICY, "l1_capacity_blocks": self.capacity_blocks,
            "hit_blocks": self.total_hit_blocks, "input_blocks": self.input_blocks, "block_hit_rate": self.hit_rate,
            "cached_tokens": self.total_cached_tokens,
            "hit_rate": self.total_cached_tokens / tokens_in if tokens_in else 0.0,
            "answer_block_tokens": self.answer_block_tokens,
        }


def reusable_tokens(request: TraceRequest, hit_blocks: int) -> int:
    """Tokens of `hit_blocks` leading blocks an engine reuses: whole blocks, never the prompt's last token."""
    usable = min(hit_blocks, max(0, request.input_length - 1) // request.block_size)
    return sum(request.block_tokens(k) for k in range(usable))


def lru_l1(records: Sequence[TrafficRecord], capacity_blocks: int) -> L1Baseline:
    """Replay `records` (any order; arrival order is used) through one LRU L1 of `capacity_blocks` blocks."""
    ordered = sorted(records, key=lambda r: r.at)  # the order trace_lines gives the sim
    trace = as_sim_trace(ordered)
    caches: list[TieredCache] = []  # the replay hands over its cache here before the first request
    hits: list[int] = []

    def before(i: int) -> None:
        hits.append(caches[0].l1.match_prefix(trace.requests[i].blocks))

    result = run_one(trace, POLICY, capacity_blocks, ReplayOptions(on_request=before, tiers=caches))
    if sum(hits) != result.l1_hit_blocks:  # the lookup must be the hit the replay counted
        raise RuntimeError(f"per-request L1 hits {sum(hits)} != the replay's {result.l1_hit_blocks}")
    tokens = tuple(reusable_tokens(req, n) for req, n in zip(trace.requests, hits, strict=True))
    seen = never_evicting_hits(trace)
    past_prompts = sum(max(0, r.hit_blocks() - n) * r.block_tokens for r, n in zip(ordered, seen, strict=True))
    return L1Baseline(capacity_blocks, tuple(hits), tokens, seen, result.input_blocks, past_prompts)
