"""`kvmesh report cost`: hosted vs self-built vs cross-turn cost of the served traffic, and a recommendation.

Records come from the running stack's TRAFFIC stream (connecting as the
stack's admin NATS user, from its state dir) or from `--trace FILE`, a
recording of `kvmesh trace record`. The logic lives in shared/report/.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="Reports built from served traffic.", no_args_is_help=True)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '12h', '7d', '1w' -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not match:
        raise typer.BadParameter(f"--since wants a duration like 30m, 12h or 7d, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _records(trace: Path | None, state_dir: Path, since: float | None):
    import asyncio

    from kvmesh.report.records import RecordsError, load_records
    from kvmesh.report.records import since as keep_since

    if trace is not None:
        try:
            return keep_since(load_records(trace), since)
        except RecordsError as exc:
            raise typer.BadParameter(str(exc)) from None
    from kvmesh.stack.traffic_access import NoStack, read_stack_records

    try:
        return asyncio.run(read_stack_records(state_dir, since))
    except NoStack as exc:
        raise typer.BadParameter(f"{exc} (or pass --trace FILE)") from None


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = report["measured"]
    console.print(f"[bold]served traffic[/]: {m['requests']} requests, {m['tokens_in']:,} tokens in, "
                  f"{m['tokens_out']:,} out, {m['cached_tokens']:,} cached ({m['hit_rate']:.1%}); "
                  f"tiers " + ", ".join(f"{t} {r:.1%}" for t, r in m["tier_hit_rates"].items()))
    console.print(f"sessions {m['sessions']} (turns mean {m['turns']['mean']:.2f}, p50 {m['turns']['p50']:.0f}, "
                  f"p90 {m['turns']['p90']:.0f}); QPS mean {m['load']['mean_qps']:.3f}, peak "
                  f"{m['load']['peak_qps']:.3f} (x{m['load']['peak_to_mean']:.2f}); "
                  f"{m['load']['requests_per_day']:,.0f} requests/day; cache writes {m['cache_write_tokens'] or 'none'}")
    table = Table(title=f"cost of this traffic (prices as of {report['prices']['as_of']})")
    for column in ("option", "model", "total USD", "USD / day", "USD / 1M tokens"):
        table.add_column(column, justify="left" if column in ("option", "model") else "right")
    for c in report["hosted"]["apis"]:
        table.add_row(c["provider"], c["model"], f"{c['total_usd']:.6f}", f"{c['per_day_usd']:.2f}",
                      f"{c['per_1m_tokens_usd']:.4f}")
    built = report["self_built"]
    gpu, base = built["model"], built["baseline"]
    caches = {"self_built": f"LRU L1 {base['l1_capacity_blocks']:,} blocks", "kvmesh_cross_turn": "kvmesh tiers"}
    for c in built["options"]:
        table.add_row(c["option"], f"{gpu['model']} on {gpu['gpu']}, {caches[c['option']]}", f"{c['total_usd']:.6f}",
                      f"{c['per_day_usd']:.2f}", f"{c['per_1m_tokens_usd']:.4f}")
    console.print(table)
    console.print(f"[dim]{report['hosted']['assumption']}. Self-built is a stated model: {gpu['prefill']}; decode "
                  f"{gpu['decode_tokens_per_s']:,.0f} tokens/s per GPU at ${gpu['gpu_hour_usd']}/GPU-hour; "
                  f"{gpu['provisioning']}. The self-built baseline is {base['what']}.[/]")
    _print_savings(console, report)
    total = report["hit_rate_over_time"]["totals"]
    console.print(f"hit rate (prompt blocks): served {total['served']:.1%}, device pools {total['served_device']:.1%}, "
                  f"at pooled L1 {report['hit_rate_over_time']['capacity_blocks']:,} blocks: Belady "
                  f"{total['belady']:.1%}, self-built LRU {total['lru_l1']:.1%}; infinite {total['infinite']:.1%}")
    console.print(f"[bold]recommendation: {report['recommendation']}[/]")
    for reason in report["reasons"]:
        console.print(f"  - {reason}")


def _print_savings(console, report: dict) -> None:
    """Where the GPU savings come from: the baseline's own L1, then what kvmesh adds on top of it."""
    from rich.table import Table

    built = report["self_built"]
    ref = built["no_cache"]
    table = Table(title=f"GPU savings, step by step (no cache: prefill {ref['prefill_gpu_s']:,.3f} GPU-s, "
                        f"${ref['total_usd']:.6f}, ${ref['per_1m_tokens_usd']:.4f} / 1M tokens)")
    for column in ("step", "more tokens cached", "prefill GPU-s saved", "USD saved", "USD / day", "USD / 1M tokens"):
        table.add_column(column, justify="left" if column == "step" else "right")
    steps = {"l1_prefix_caching": "no cache -> self_built", "kvmesh_on_top": "self_built -> kvmesh_cross_turn"}
    for s in built["savings"]:
        table.add_row(f"{s['source']} ({steps[s['source']]})", f"{s['cached_tokens']:,} ({s['hit_rate']:.1%})",
                      f"{s['prefill_gpu_s']:,.3f}", f"{s['usd']:.6f}", f"{s['per_day_usd']:.2f}",
                      f"{s['per_1m_tokens_usd']:.4f}")
    console.print(table)
    console.print(f"[dim]l1_prefix_caching: the baseline engine's own LRU L1 (what vLLM or SGLang give for free); "
                  f"kvmesh_on_top: kvmesh's hits minus the baseline's (L2/L3 tiers, routing, retention). kvmesh's hits "
                  f"include {built['baseline']['answer_block_tokens']:,} tokens of blocks no earlier prompt held (a "
                  f"previous answer wrote them): the baseline replays prompts only, though an engine that caches its "
                  f"generated blocks may hit those too.[/]")


@app.command("cost")
def cost(
    since: Annotated[Optional[str], typer.Option(help="Only traffic of the last D (30m, 12h, 7d; default: all kept).")] = None,
    prices: Annotated[Optional[Path], typer.Option(help="Price file (default: the shipped, dated prices.yaml).",
                                                   exists=True, dir_okay=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
    html: Annotated[Optional[Path], typer.Option(help="Write an HTML page here, with its PNG plots beside it.",
                                                 dir_okay=False)] = None,
    trace: Annotated[Optional[Path], typer.Option(help="A recorded JSONL (kvmesh trace record) instead of the stack.",
                                                  exists=True, dir_okay=False)] = None,
    gpu_hour_usd: Annotated[Optional[float], typer.Option(min=0.0, help="GPU-hour price (default: the price file's).")] = None,
    capacity_blocks: Annotated[Optional[int], typer.Option(
        min=1, help="Pooled L1 blocks for the Belady line and the self-built engine's LRU L1 "
                   "(default: engine L1 blocks x workers seen).")] = None,
    ttft_slo_ms: Annotated[Optional[float], typer.Option(min=0.0, help="Your TTFT target, ms (none: latency-tolerant).")] = None,
    hit_rate_target: Annotated[Optional[float], typer.Option(
        min=0.0, max=1.0, help="A hit rate you must hold (a strict need favors cross-turn scheduling).")] = None,
    window_s: Annotated[Optional[float], typer.Option(
        "--window-s", min=1.0, help="Hit-rate window of the plot (default: ~30 over the span, at least 60 s).")] = None,
    state_dir: Annotated[Optional[Path], typer.Option(
        "--state-dir", help="The stack's state dir (default: settings state_dir).")] = None,
) -> None:
    """Price the served traffic on hosted APIs, a self-built engine and kvmesh, and recommend one."""
    from kvmesh.config import load_settings
    from kvmesh.report.cost_report import ReportOptions, build_report, default_capacity
    from kvmesh.report.measure import measure
    from kvmesh.report.prices import PriceFileError, load_prices

    settings = load_settings()
    start = None if since is None else time.time() - parse_duration(since)
    try:
        book = load_prices(prices)
    except PriceFileError as exc:
        raise typer.BadParameter(str(exc)) from None
    records = _records(trace, state_dir or settings.state_dir, start)
    if not records:
        typer.echo("kvmesh report cost: no served traffic in the window", err=True)
        raise typer.Exit(1)
    per_worker = settings.eviction.l1_capacity_blocks or settings.engine.num_blocks
    capacity = capacity_blocks or default_capacity(per_worker, measure(records).workers)
    report = build_report(records, book, ReportOptions(capacity, gpu_hour_usd, ttft_slo_ms, hit_rate_target, window_s))
    if html is not None:
        from kvmesh.report.html import write_html

        report["html"] = [str(p) for p in write_html(report, html)]
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _print_table(report)
        if html is not None:
            typer.echo(f"wrote {', '.join(report['html'])}")
