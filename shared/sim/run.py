"""Run several policies (and the references) over one trace at one or many capacities.

Names: the online policies of ``kvmesh.cache_policy.registry`` (the first,
``default``, is the shipped one), its queue-structured references (``s3fifo``,
``arc``), plus ``belady`` (offline farthest-next-use bound, run over both
tiers) and ``infinite`` (a cache that never evicts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kvmesh.cache_policy.registry import (
    POLICIES,
    QUEUE_POLICIES,
    get_policy,
    get_queue_policy,
)
from kvmesh.sim.belady import BeladyPolicy
from kvmesh.sim.replay import (
    Progress,
    ReplayOptions,
    ReplayResult,
    infinite_hit_rate,
    replay,
)
from kvmesh.sim.trace import Trace

REFERENCES = ("belady", "infinite")


def all_names() -> list[str]:
    return [*POLICIES, *QUEUE_POLICIES, *REFERENCES]


def resolve_names(names: Sequence[str] | None) -> list[str]:
    """Report names in a stable order; unknown names raise ``ValueError``."""
    if not names:
        return all_names()
    wanted = set(names)
    unknown = wanted - set(all_names())
    if unknown:
        raise ValueError(f"unknown policy {sorted(unknown)}; known: {', '.join(all_names())}")
    return [n for n in all_names() if n in wanted]


def capacity_for(trace: Trace, fraction: float) -> int:
    """A capacity as a fraction of the trace's unique blocks (at least one block)."""
    if not 0 < fraction:
        raise ValueError(f"capacity fraction must be > 0, got {fraction}")
    return max(1, round(fraction * trace.unique_blocks))


def run_one(trace: Trace, name: str, capacity: int, options: ReplayOptions | None = None) -> ReplayResult:
    """Replay one named policy (or reference) at L1 ``capacity`` (L2 and TTFT per ``options``)."""
    opts = options or ReplayOptions()
    if name == "infinite":
        if opts.progress is not None:
            opts.progress(len(trace.requests))
        return infinite_hit_rate(trace)
    if name == "belady":
        oracle = BeladyPolicy(trace)
        return replay(trace, oracle, capacity, on_request=oracle.at_request, options=opts)
    if name in QUEUE_POLICIES:
        return replay(trace, get_queue_policy(name), capacity, options=opts)
    return replay(trace, get_policy(name), capacity, options=opts)


def hit_rate(trace: Trace, name: str, capacity: int, progress: Progress | None = None) -> float:
    """Prefix-hit blocks / input blocks of one named policy at one capacity (L1 only)."""
    return run_one(trace, name, capacity, ReplayOptions(progress=progress)).hit_rate


def run_all(
    trace: Trace,
    names: Sequence[str],
    capacity: int,
    progress: Progress | None = None,
) -> dict[str, float]:
    return {name: hit_rate(trace, name, capacity, progress) for name in names}


def run_all_tiers(trace: Trace, names: Sequence[str], capacity: int,
                  options: ReplayOptions | None = None) -> dict[str, ReplayResult]:
    """Every named policy at L1 ``capacity``, with the L2 and TTFT model of ``options``."""
    return {name: run_one(trace, name, capacity, options) for name in names}


def sweep(
    trace: Trace,
    names: Sequence[str],
    fractions: Sequence[float],
    progress: Progress | None = None,
    on_point: Callable[[str, float], None] | None = None,
    options: ReplayOptions | None = None,
) -> dict[str, list[float]]:
    """L1 hit rate per name for each L1 capacity fraction (L2 fixed, per ``options``)."""
    opts = options or ReplayOptions()
    if progress is not None:
        opts = replace(opts, progress=progress)
    curves: dict[str, list[float]] = {name: [] for name in names}
    for fraction in fractions:
        capacity = capacity_for(trace, fraction)
        for name in names:
            curves[name].append(run_one(trace, name, capacity, opts).l1_hit_rate)
            if on_point is not None:
                on_point(name, fraction)
    return curves


# The L1 curve of agent workloads: from a pool far too small for the sessions in flight to a comfortable one.
L1_SWEEP_FRACTIONS = (0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3)


def default_fractions(points: int = 8, low: float = 0.01, high: float = 0.5) -> list[float]:
    """Geometric capacity fractions from ``low`` to ``high`` (a log-x sweep)."""
    ratio = (high / low) ** (1 / (points - 1))
    return [low * ratio**i for i in range(points)]
