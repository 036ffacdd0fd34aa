"""`kvmesh sim`: replay a hash-id trace through the eviction policies vs the Belady bound.

L1 (the device pool) and L2 (host memory, fed by L1's evictions) take
separate capacities; each policy's prefix hit rate is reported per tier,
with a modeled TTFT (shared/sim/ttft.py) and, for session-aware policies,
the return-time prediction error.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

POLICY_HELP = ("Policy to run (repeatable): default, session, cost, lru, lfu, tinylfu, continuum, "
               "s3fifo, arc, belady, infinite.")


def _capacity(data, blocks: int | None, fraction: float | None, what: str, required: bool) -> int:
    from kvmesh.sim.run import capacity_for

    if blocks is not None and fraction is not None:
        raise typer.BadParameter(f"give at most one of --{what}-blocks or --{what}-fraction")
    if blocks is None and fraction is None:
        if required:
            raise typer.BadParameter("give exactly one of --l1-blocks (--capacity-blocks) or --l1-fraction (--capacity-fraction)")
        return 0
    if blocks is not None:
        if blocks < 0:
            raise typer.BadParameter(f"--{what}-blocks must be >= 0")
        return blocks
    try:
        return capacity_for(data, fraction or 0.0)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def sim(
    trace: Annotated[Path, typer.Option(help="JSONL trace (timestamp ms, hash_ids, optional session_id / tool_calls).",
                                        exists=True, dir_okay=False)],
    l1_blocks: Annotated[int | None, typer.Option("--l1-blocks", "--capacity-blocks", help="L1 capacity in blocks.")] = None,
    l1_fraction: Annotated[float | None, typer.Option(
        "--l1-fraction", "--capacity-fraction", help="L1 capacity as a fraction of the trace's unique blocks.")] = None,
    l2_blocks: Annotated[int | None, typer.Option(help="L2 capacity in blocks (default: no L2).")] = None,
    l2_fraction: Annotated[float | None, typer.Option(help="L2 capacity as a fraction of the unique blocks.")] = None,
    policy: Annotated[list[str] | None, typer.Option(help=POLICY_HELP)] = None,
    sweep: Annotated[bool, typer.Option("--sweep", help="Also sweep L1 from 2% to 30% of the unique blocks (JSON 'sweep').")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the sweep here (without --sweep: 1%..50%).")] = None,
    pin_fraction: Annotated[float | None, typer.Option(
        help="Share of L1 that session pins may hold (default: each policy's own; continuum: unbounded).")] = None,
    decode_tokens_per_s: Annotated[float, typer.Option(
        help="Decode rate that stamps a turn's end (its outcome event) after arrival: output_length / rate; "
             "0: at arrival.")] = 50.0,
    geometry: Annotated[str, typer.Option(help="Model geometry of the TTFT model: 8b or 70b.")] = "8b",
    l2_gbps: Annotated[float | None, typer.Option(help="L2 -> GPU restore rate of the TTFT model, GB/s.")] = None,
    groups: Annotated[bool, typer.Option(
        help="Link a sub-agent to the parent its trace line names (parent_session_id); off: to measure what "
             "that gives.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Replay TRACE and print each policy's prefix hit rate per tier and its modeled TTFT."""
    from kvmesh.sim.replay import ReplayOptions, summarize
    from kvmesh.sim.run import (
        L1_SWEEP_FRACTIONS,
        default_fractions,
        resolve_names,
        run_all_tiers,
    )
    from kvmesh.sim.run import sweep as run_sweep
    from kvmesh.sim.trace import load_trace, returning
    from kvmesh.sim.ttft import DEFAULT_L2_GBPS, TTFTModel
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    try:
        names = resolve_names(policy)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if pin_fraction is not None and not 0.0 <= pin_fraction <= 1.0:
        raise typer.BadParameter("--pin-fraction must be in [0, 1]")
    if decode_tokens_per_s < 0:
        raise typer.BadParameter("--decode-tokens-per-s must be >= 0")
    if geometry not in ("8b", "70b"):
        raise typer.BadParameter("--geometry must be 8b or 70b")
    data = load_trace(trace)
    later = returning(data)
    capacity = _capacity(data, l1_blocks, l1_fraction, "l1", required=True)
    l2 = _capacity(data, l2_blocks, l2_fraction, "l2", required=False)
    model = TTFTModel(geometry=geometry, l2_gbps=l2_gbps or DEFAULT_L2_GBPS)

    err = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    fractions = list(L1_SWEEP_FRACTIONS) if sweep or plot is None else default_fractions()
    curves = None
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(f"replay @ L1 {capacity} / L2 {l2} blocks", total=len(names) * len(data.requests))
        base = ReplayOptions(l2_capacity=l2, pin_fraction=pin_fraction, decode_tokens_per_s=decode_tokens_per_s,
                             groups=groups)
        results = run_all_tiers(data, names, capacity,
                                replace(base, ttft=model, progress=lambda n: bar.advance(task, n)))
        if sweep or plot is not None:
            sweep_task = bar.add_task("L1 sweep", total=len(fractions) * len(names) * len(data.requests))
            curves = run_sweep(data, names, fractions, lambda n: bar.advance(sweep_task, n),
                               options=base)

    if plot is not None and curves is not None:
        from kvmesh.sim.plot import plot_sweep

        plot_sweep(fractions, curves, data.unique_blocks, f"{data.name}: L1 prefix hit rate vs L1 capacity", plot)
        err.print(f"plot written to {plot}")

    def r6(x: float) -> float:
        return round(x, 6)

    out: dict = {
        "trace": data.name,
        "capacity_blocks": capacity,
        "l2_capacity_blocks": l2,
        "unique_blocks": data.unique_blocks,
        "hit_rate": {n: r6(r.hit_rate) for n, r in results.items()},
        "l1_hit_rate": {n: r6(r.l1_hit_rate) for n, r in results.items()},
        "l2_hit_rate": {n: r6(r.l2_hit_rate) for n, r in results.items()},
        "ttft_s": {n: {k: r6(v) for k, v in (summarize(r.ttft_s) or {}).items()} for n, r in results.items()
                   if r.ttft_s},
        # the later turns of named sessions: their prefix was computed before (first turns are cold for all)
        "ttft_s_returning": {n: {k: r6(v) for k, v in (summarize(tuple(
            t for t, again in zip(r.ttft_s, later) if again)) or {}).items()} for n, r in results.items()
            if r.ttft_s and any(later)},
        "prediction_error_s": {n: {k: r6(v) for k, v in (summarize(r.prediction_errors_s) or {}).items()}
                               | {"mean_abs": r6(sum(map(abs, r.prediction_errors_s)) / len(r.prediction_errors_s))}
                               for n, r in results.items() if r.prediction_errors_s},
        "pinned_max_blocks": {n: r.pinned_max for n, r in results.items() if r.pinned_max},
        "pin_fraction": pin_fraction,
        "decode_tokens_per_s": decode_tokens_per_s,
        "groups": groups,
        "ttft_model": model.describe(),
    }
    if curves is not None:
        out["sweep"] = {"l1_fractions": fractions, "l1_hit_rate": {n: [r6(x) for x in c] for n, c in curves.items()}}
    if as_json:
        typer.echo(json.dumps(out))
        return
    _print_table(out, data.name)


def _print_table(out: dict, name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    rates = out["hit_rate"]
    table = Table(title=f"{name}: L1 {out['capacity_blocks']:,} / L2 {out['l2_capacity_blocks']:,} "
                        f"of {out['unique_blocks']:,} unique blocks")
    for col in ("policy", "hit rate", "L1", "L2", "x lru", "x belady", "TTFT p50 s", "TTFT p99 s"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    lru, bel = rates.get("lru"), rates.get("belady")
    for policy, rate in rates.items():
        ttft = out["ttft_s"].get(policy, {})
        table.add_row(
            policy, f"{100 * rate:.2f}%", f"{100 * out['l1_hit_rate'][policy]:.2f}%",
            f"{100 * out['l2_hit_rate'][policy]:.2f}%",
            f"{rate / lru:.2f}" if lru else "-", f"{rate / bel:.2f}" if bel else "-",
            f"{ttft['p50']:.3f}" if ttft else "-", f"{ttft['p99']:.3f}" if ttft else "-",
        )
    Console().print(table)
    if "sweep" in out:
        sweep = Table(title="L1 hit rate vs L1 capacity (% of unique blocks)")
        sweep.add_column("policy")
        for f in out["sweep"]["l1_fractions"]:
            sweep.add_column(f"{100 * f:.3g}%", justify="right")
        for policy, ys in out["sweep"]["l1_hit_rate"].items():
            sweep.add_row(policy, *(f"{100 * y:.1f}" for y in ys))
        Console().print(sweep)
