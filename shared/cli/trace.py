"""`kvmesh trace from-trajectories|record`: hash-id traces for `kvmesh sim`.

`from-trajectories`: agent trajectories as a trace of interleaved sessions
(the logic lives in shared/sim/trajectories.py). `record`: the running
stack's served traffic (stream TRAFFIC, read as the stack's admin NATS
user) as a trace: tenant-hashed, no prompt text (shared/traffic/). Both
print a one-line JSON summary on stdout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="Build hash-id request traces for `kvmesh sim`.", no_args_is_help=True)


@app.command("from-trajectories")
def from_trajectories(
    directory: Annotated[Path, typer.Argument(help="Folder of SWE-agent .traj files.", exists=True, file_okay=False)],
    out: Annotated[Path, typer.Option(help="JSONL trace to write.", dir_okay=False)],
    sessions: Annotated[int, typer.Option(min=1, help="Sessions (trajectories drawn with replacement).")] = 400,
    rate: Annotated[float, typer.Option(min=0.0, help="Session arrivals per second (Poisson).")] = 2.0,
    seed: Annotated[int, typer.Option(help="Seed of arrivals, draws and session salts.")] = 0,
    output_tokens_per_s: Annotated[float, typer.Option(min=0.0, help="Decode rate a turn generates at.")] = 50.0,
    tool_median_s: Annotated[float, typer.Option(help="Median tool latency when none is recorded.")] = 1.5,
    tool_sigma: Annotated[float, typer.Option(help="Log-normal sigma of tool latency.")] = 0.8,
    tool_cap_s: Annotated[float, typer.Option(help="Longest drawn tool latency.")] = 30.0,
    follow_up: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Chance a finished task gets a follow-up task.")
    ] = 0.25,
    human_median_s: Annotated[float, typer.Option(help="Median human gap before a follow-up.")] = 90.0,
    human_sigma: Annotated[float, typer.Option(help="Log-normal sigma of the human gap.")] = 1.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Context limit (the agent preset's positions).")] = 32768,
    shared_system_prompt: Annotated[
        bool, typer.Option(help="Sessions share the system prompt's blocks (one deployment's agents).")
    ] = True,
    session_ids: Annotated[
        bool, typer.Option(help="Write each turn's session_id (off: a server would have to infer the sessions).")
    ] = True,
    sub_agents: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="Chance a session forks a sub-agent at one of its tool calls (parent_session_id).")] = 0.0,
    sub_agent_turns: Annotated[int, typer.Option(min=1, help="The most turns a sub-agent runs.")] = 8,
) -> None:
    """Turn DIRECTORY's trajectories into a Mooncake-format trace with session_id and tool_calls."""
    from kvmesh.sim.trajectories import (
        SessionsConfig,
        Timing,
        agent_preset_tokenizer,
        build_trace,
        load_trajectories,
        summarize,
        write_trace,
    )
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    if rate <= 0 or output_tokens_per_s <= 0:
        raise typer.BadParameter("--rate and --output-tokens-per-s must be > 0")
    timing = Timing(
        output_tokens_per_s=output_tokens_per_s, tool_median_s=tool_median_s, tool_sigma=tool_sigma,
        tool_cap_s=tool_cap_s, follow_up=follow_up, human_median_s=human_median_s, human_sigma=human_sigma,
    )
    config = SessionsConfig(
        sessions=sessions, rate=rate, seed=seed, timing=timing, max_tokens=max_tokens,
        share_system_prompt=shared_system_prompt, sub_agents=sub_agents, sub_agent_turns=sub_agent_turns,
    )
    err = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        setup = bar.add_task("agent preset tokenizer", total=None)
        tokenizer = agent_preset_tokenizer()
        bar.update(setup, description="tokenize trajectories", total=len(list(directory.glob("*.traj"))))
        try:
            pool = load_trajectories(directory, tokenizer, lambda _: bar.advance(setup))
        except (FileNotFoundError, ValueError) as exc:
            raise typer.BadParameter(str(exc)) from None
        task = bar.add_task("sessions", total=sessions)
        rows = build_trace(pool, config, lambda n: bar.advance(task, n))
        bar.add_task(f"write {out}", total=None)
        write_trace(rows, out, session_ids)
    typer.echo(json.dumps({"trace": str(out), **summarize(rows)}))


@app.command("record")
def record(
    out: Annotated[Path, typer.Option(help="JSONL trace to write.", dir_okay=False)],
    since: Annotated[Optional[str], typer.Option(help="Only traffic of the last D (30m, 12h, 7d; default: all kept).")] = None,
    state_dir: Annotated[Optional[Path], typer.Option(
        "--state-dir", help="The stack's state dir (default: settings state_dir).")] = None,
) -> None:
    """Write the running stack's served requests as a trace `kvmesh sim --trace OUT` replays."""
    import asyncio
    import time

    from kvmesh.cli.report import parse_duration
    from kvmesh.config import load_settings
    from kvmesh.stack.traffic_access import NoStack, read_stack_records
    from kvmesh.traffic.trace_lines import write_trace

    start = None if since is None else time.time() - parse_duration(since)
    try:
        records = asyncio.run(read_stack_records(state_dir or load_settings().state_dir, start))
    except NoStack as exc:
        raise typer.BadParameter(str(exc)) from None
    lines = write_trace(records, out)
    sessions = {r.session_id for r in records if r.session_id}
    typer.echo(json.dumps({"trace": str(out), "requests": lines, "sessions": len(sessions),
                           "input_blocks": sum(len(r.hash_ids) for r in records),
                           "tenants": len({r.tenant for r in records})}))
