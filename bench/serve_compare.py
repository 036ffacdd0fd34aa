"""How two of `kvmesh bench serve`'s modes compare: their figures' ratios, and whether they answered alike.

Ratios are always `a / b` of one figure (`a` the mode named first): a TTFT ratio
below 1 and a cached or throughput ratio above 1 mean `a` did better. The
answers are compared request by request (session and turn): the modes serve
the same prompts greedily, so a cache that is transparent gives the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.bench.serve import Sample

RATIO_FIGURES = ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "cached_token_ratio", "output_tokens_per_s",
                 "requests_per_s")


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """`a[f] / b[f]` for each of RATIO_FIGURES (None where `b[f]` is 0: cache off caches nothing)."""
    return {f: round(a[f] / b[f], 3) if b[f] else None for f in RATIO_FIGURES}


def same_answers(a: Sequence[Sample], b: Sequence[Sample]) -> str:
    """'n/N': of the N requests both runs made (by session and turn), n got the same answer text."""
    theirs = {s.key: s.text for s in b}
    both = [s for s in a if s.key in theirs]
    return f"{sum(s.text == theirs[s.key] for s in both)}/{len(both)}"
