"""`kvmesh chaos list|run`: fault-injection scenarios against a local stack the command starts and stops.

`run` starts real NATS, S3 and the services in a tmp dir, computes the
fault-free references, runs the scenarios named (all by default), prints
one JSON report per scenario (or a summary table), and exits 1 if any
invariant failed or the stack leaked a process or port.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="Chaos scenarios: inject faults into a local stack and check invariants.", no_args_is_help=True)


@app.command("list")
def list_scenarios() -> None:
    """Name every scenario and what it injects."""
    from kvmesh.chaos.scenarios import SCENARIOS

    for scenario in SCENARIOS.values():
        typer.echo(f"{scenario.name:18} {scenario.doc}")


@app.command()
def run(
    names: Annotated[Optional[list[str]], typer.Argument(help="Scenarios to run (default: all).")] = None,
    duration: Annotated[float, typer.Option(help="Seconds each timed fault lasts.")] = 10.0,
    sessions: Annotated[int, typer.Option(help="Concurrent greedy client sessions.")] = 3,
    nats_nodes: Annotated[int, typer.Option(help="NATS nodes: 3 = a cluster with R3 streams (nats-leader-kill).")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON report per line.")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG timeline per scenario here.")] = None,
) -> None:
    """Start a local stack, run the scenarios in order, report, stop the stack."""
    import tempfile

    from kvmesh.chaos.load import Load
    from kvmesh.chaos.scenarios import SCENARIOS
    from kvmesh.chaos.scenarios import run as run_scenario
    from kvmesh.chaos.stack import API_KEY, ChaosStack
    from kvmesh.engine.presets import write_preset

    chosen = names or list(SCENARIOS)
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        typer.echo(f"kvmesh chaos: unknown scenario(s) {', '.join(unknown)}; see `kvmesh chaos list`", err=True)
        raise typer.Exit(2)
    failed = False
    with tempfile.TemporaryDirectory(prefix="kvmesh-chaos-") as tmp:
        root = Path(tmp)
        stack = ChaosStack(root, write_preset(root / "tiny-llama", "tiny", "llama", seed=0),
                           nats_nodes=nats_nodes)
        try:
            typer.echo("starting the stack...", err=True)
            stack.start()
            refs = Load(stack.base_url, API_KEY, stack.model_dir.name).references()
            for name in chosen:
                typer.echo(f"running {name}...", err=True)
                report = run_scenario(stack, SCENARIOS[name], refs, duration_s=duration, plot_dir=plot,
                                      sessions=sessions)
                failed |= not all(report["invariants"].values())
                typer.echo(json.dumps(report) if as_json else _line(report))
        finally:
            leaks = stack.stop()
        if leaks:
            typer.echo(f"kvmesh chaos: leaked after stop: {', '.join(leaks)}", err=True)
    raise typer.Exit(1 if failed or leaks else 0)


def _line(report: dict) -> str:
    bad = [k for k, v in report["invariants"].items() if not v]
    req, lat = report["requests"], report["latency_p99_ms"]
    return (f"{report['scenario']:18} sent={req['sent']} ok={req['ok']} err={req['errored']} "
            f"p99 base/fault={lat['baseline']:.0f}/{lat['fault'] or 0:.0f} ms recovery={report['recovery_s']} s "
            f"{'OK' if not bad else 'FAILED: ' + ', '.join(bad)}")
