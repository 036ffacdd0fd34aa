"""`kvmesh sim`: replay a hash-id trace through the eviction policies vs the Belady bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def sim(
    trace: Annotated[Path, typer.Option(help="JSONL trace (timestamp ms, hash_ids ...).", exists=True, dir_okay=False)],
    capacity_blocks: Annotated[int | None, typer.Option(help="Cache capacity in blocks.")] = None,
    capacity_fraction: Annotated[
        float | None, typer.Option(help="Cache capacity as a fraction of the trace's unique blocks.")
    ] = None,
    policy: Annotated[
        list[str] | None, typer.Option(help="Policy to run (repeatable): default/cost, lru, lfu, tinylfu, belady, infinite.")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Also sweep capacity 1%..50% and write a PNG here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Replay TRACE at one capacity and print each policy's prefix hit rate (blocks)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from shared.sim.run import capacity_for, default_fractions, resolve_names, run_all, sweep
    from shared.sim.trace import load_trace

    if (capacity_blocks is None) == (capacity_fraction is None):
        raise typer.BadParameter("give exactly one of --capacity-blocks or --capacity-fraction")
    try:
        names = resolve_names(policy)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    data = load_trace(trace)
    try:
        capacity = capacity_blocks if capacity_blocks is not None else capacity_for(data, capacity_fraction or 0.0)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if capacity < 0:
        raise typer.BadParameter("--capacity-blocks must be >= 0")

    err = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(f"replay @ {capacity} blocks", total=len(names) * len(data.requests))
        rates = run_all(data, names, capacity, lambda n: bar.advance(task, n))
        if plot is not None:
            fractions = default_fractions()
            sweep_task = bar.add_task("capacity sweep", total=len(fractions) * len(names) * len(data.requests))
            curves = sweep(data, names, fractions, lambda n: bar.advance(sweep_task, n))

    if plot is not None:
        from shared.sim.plot import plot_sweep

        plot_sweep(fractions, curves, data.unique_blocks, f"{data.name}: prefix hit rate vs capacity", plot)
        err.print(f"plot written to {plot}")

    result = {
        "trace": data.name,
        "capacity_blocks": capacity,
        "unique_blocks": data.unique_blocks,
        "hit_rate": {name: round(rate, 6) for name, rate in rates.items()},
    }
    if as_json:
        typer.echo(json.dumps(result))
        return
    from rich.table import Table

    table = Table(title=f"{data.name}: {capacity:,} of {data.unique_blocks:,} unique blocks")
    table.add_column("policy")
    table.add_column("hit rate", justify="right")
    table.add_column("x lru", justify="right")
    table.add_column("x belady", justify="right")
    for name, rate in rates.items():
        lru, bel = rates.get("lru"), rates.get("belady")
        table.add_row(
            name,
            f"{100 * rate:.2f}%",
            f"{rate / lru:.2f}" if lru else "-",
            f"{rate / bel:.2f}" if bel else "-",
        )
    Console().print(table)
