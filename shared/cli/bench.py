"""`kvmesh bench ...`: benchmarks that print one JSON object of side-by-side ratios.

A typer group; each benchmark is one command (`engine` here; others add
theirs with `@app.command()` in this module's app).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from kvmesh.config import BusSettings, ServiceSettings

app = typer.Typer(help="Benchmarks: side by side, as ratios, one JSON object.", no_args_is_help=True)


@app.command()
def engine(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    model: Annotated[Path | None, typer.Option(help="Checkpoint dir; default: the `small` preset in a temp dir.")] = None,
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length for the TTFT runs.")] = 2048,
    decode_tokens: Annotated[int, typer.Option(help="New tokens per sequence in the decode runs.")] = 32,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated decode batch sizes.")] = "1,8,32",
    repeats: Annotated[int, typer.Option(help="Timed runs per case (median).")] = 3,
    threads: Annotated[int, typer.Option(help="torch threads (0 = default); 1 is steadier on a shared machine.")] = 0,
) -> None:
    """Prefill TTFT vs cached fraction, decode tokens/s vs HF transformers, KV bytes per token."""
    from kvmesh.bench.engine import EngineBenchConfig, run_engine_bench

    cfg = EngineBenchConfig(
        model_dir=model,
        prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens,
        batch_sizes=tuple(int(b) for b in batch_sizes.split(",") if b.strip()),
        repeats=repeats,
        threads=threads,
    )
    result = run_engine_bench(cfg)
    typer.echo(json.dumps(result, indent=None if json_out else 2))


@app.command()
def tiers(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    blocks: Annotated[int, typer.Option(help="Blocks of the small model's shape per tier run.")] = 1000,
    restore_tokens: Annotated[int, typer.Option(help="Prefix length for L3 restore vs recompute.")] = 2048,
    restore: Annotated[bool, typer.Option(help="Run the small-model restore vs recompute comparison.")] = True,
) -> None:
    """L2 vs memcpy, L3 vs raw minio put/get, L3 prefix restore vs recompute (small preset)."""
    from kvmesh.bench.tiers import TierBenchConfig, run_tiers_bench

    result = run_tiers_bench(TierBenchConfig(blocks=blocks, restore_tokens=restore_tokens, restore=restore))
    typer.echo(json.dumps(result, indent=None if json_out else 2))


@app.command()
def bus(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    messages: Annotated[int, typer.Option(help="Messages per measurement.")] = 1000,
) -> None:
    """JetStream publish (sequential vs concurrent vs core NATS), consumer batch 1 vs 16, typed vs raw request."""
    from kvmesh.bench.bus import BusBenchConfig, run_bus_bench

    result = run_bus_bench(BusBenchConfig(messages=messages))
    typer.echo(json.dumps(result, indent=None if json_out else 2))


@app.command()
def serve(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    model: Annotated[Path | None, typer.Option(help="Checkpoint dir; default: --preset in a temp dir.")] = None,
    preset: Annotated[str, typer.Option(help="tiny or small (when --model is not given).")] = "tiny",
    concurrency: Annotated[int, typer.Option(min=1, help="Sessions driven at once.")] = 4,
    sessions: Annotated[int, typer.Option(min=1, help="Agent sessions (conversations).")] = 8,
    turns: Annotated[int, typer.Option(min=1, help="Turns per session.")] = 4,
    max_tokens: Annotated[int, typer.Option(min=2, help="Tokens per answer.")] = 16,
    l3: Annotated[bool, typer.Option(help="kvmesh mode's workers with the S3 tier (--no-l3: L2 only).")] = True,
    prefill: Annotated[int, typer.Option(min=1, help="Prefill workers per stack (routing between them matters).")] = 2,
    l1_blocks: Annotated[int, typer.Option(min=64, help="Each engine's KV pool in blocks, every mode (default: less "
                                                       "than the sessions need together).")] = 512,
) -> None:
    """Multi-turn agent workload through the OpenAI SDK: kvmesh vs the engines' own prefix cache alone vs no cache."""
    from kvmesh.bench.serve import ServeBenchConfig
    from kvmesh.bench.serve_run import run_serve_bench

    cfg = ServeBenchConfig(model_dir=model, preset=preset, concurrency=concurrency, sessions=sessions, turns=turns,
                           max_tokens=max_tokens, l3=l3, prefill=prefill, l1_blocks=l1_blocks)
    typer.echo(json.dumps(run_serve_bench(cfg), indent=None if json_out else 2))


@app.command()
def agents(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    sessions: Annotated[int, typer.Option(min=1, help="Concurrent agent sessions (trajectories, round-robin).")] = 12,
    max_steps: Annotated[int, typer.Option(min=1, help="Tool-calling steps per session.")] = 10,
    l1_blocks: Annotated[int, typer.Option(min=64, help="KV pool blocks per worker (small: eviction matters).")] = 3072,
    l2_blocks: Annotated[int, typer.Option(min=0, help="Host-memory tier per worker, in blocks.")] = 1024,
    arrival_rate: Annotated[float, typer.Option(min=0.01, help="Sessions starting per second (Poisson).")] = 1.0,
    l3: Annotated[bool, typer.Option(help="Workers with the S3 tier (off: an evicted context is recomputed).")] = False,
    seed: Annotated[int, typer.Option(help="Seed of arrivals and tool latencies.")] = 0,
    tool_median_s: Annotated[float, typer.Option(
        min=0.0, help="Median tool run between calls (log-normal, capped at 4x): longer runs keep more sessions "
                      "active at once at the same compute rate.")] = 1.5,
) -> None:
    """Agent sessions (SWE-agent tool loops) on a small L1: the shipped default vs retention off vs LRU."""
    from kvmesh.bench.agents import AgentsBenchConfig, run_agents_bench

    cfg = AgentsBenchConfig(sessions=sessions, max_steps=max_steps, l1_blocks=l1_blocks, l2_blocks=l2_blocks,
                            arrival_rate=arrival_rate, l3=l3, seed=seed, tool_median_s=tool_median_s)
    typer.echo(json.dumps(run_agents_bench(cfg), indent=None if json_out else 2))


@app.command()
def index(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    blocks: Annotated[int, typer.Option(help="Blocks indexed (chains over 8 workers' L1/L2, some L3).")] = 1_000_000,
    lookups: Annotated[int, typer.Option(help="Lookup queries per measurement.")] = 2000,
    chain: Annotated[int, typer.Option(help="Blocks per context chain = blocks per lookup query.")] = 128,
    scale: Annotated[str, typer.Option(help="Comma-separated index sizes (e.g. 1000000,3000000,10000000): memory, "
                                            "lookups/s per core and snapshot per size, instead of the default run.")] = "",
    scale_workers: Annotated[int, typer.Option(help="With --scale: workers the blocks spread over.")] = 1000,
) -> None:
    """Cache index: lookup p50/p99 in-process vs over NATS, ingest rate, restart (snapshot + replay) to ready."""
    if scale:
        from kvmesh.bench.index_scale import ScaleConfig, run_index_scale

        sizes = tuple(int(b) for b in scale.split(",") if b.strip())
        result = run_index_scale(ScaleConfig(sizes=sizes, workers=scale_workers, chain=chain, lookups=lookups))
        typer.echo(json.dumps(result, indent=None if json_out else 2))
        return
    from kvmesh.bench.index import IndexBenchConfig, run_index_bench

    result = run_index_bench(IndexBenchConfig(blocks=blocks, lookups=lookups, chain=chain))
    typer.echo(json.dumps(result, indent=None if json_out else 2))


@app.command()
def datapath(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    geometry: Annotated[str, typer.Option(help="KV geometry: 8b (Llama-3-8B) or 70b (Llama-3-70B).")] = "8b",
    context: Annotated[int, typer.Option(help="Session context in tokens.")] = 16384,
    turns: Annotated[int, typer.Option(help="Turns of the growing session (L3 write amplification).")] = 30,
    repeats: Annotated[int, typer.Option(help="Timed runs per path (best kept).")] = 2,
    mfu: Annotated[float, typer.Option(help="Model FLOPs utilization of the modeled H200 recompute.")] = 0.5,
) -> None:
    """KV restores (L2, peer, L3, handoff) vs memcpy and modeled H200 recompute; L3 writes of a growing session."""
    from kvmesh.bench.datapath import DatapathConfig, run_datapath_bench
    from kvmesh.sim.recompute_model import GEOMETRIES

    if geometry not in GEOMETRIES:
        raise typer.BadParameter(f"unknown geometry {geometry!r} (choose from {', '.join(GEOMETRIES)})")
    result = run_datapath_bench(DatapathConfig(geometry, context, turns, repeats, mfu))
    typer.echo(json.dumps(result, indent=None if json_out else 2))


@app.command()
def constrained(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    model: Annotated[Path | None, typer.Option(help="Checkpoint dir; default: --preset in a temp dir.")] = None,
    preset: Annotated[str, typer.Option(help="tiny, agent or small (when --model is not given).")] = "tiny",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated decode batch sizes.")] = "1,8",
    decode_tokens: Annotated[int, typer.Option(min=8, help="Decode steps per run.")] = 64,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per case (median).")] = 5,
    threads: Annotated[int, typer.Option(help="torch threads (0 = default).")] = 0,
) -> None:
    """Per-step decode cost with grammar masks vs without, same engine and prompts (overhead_b1, overhead_b8)."""
    from kvmesh.bench.constrained import ConstrainedBenchConfig, run_constrained_bench

    cfg = ConstrainedBenchConfig(model_dir=model, preset=preset, decode_tokens=decode_tokens, repeats=repeats,
                                 batch_sizes=tuple(int(b) for b in batch_sizes.split(",") if b.strip()), threads=threads)
    typer.echo(json.dumps(run_constrained_bench(cfg), indent=None if json_out else 2))


@app.command("grammar-libs")
def grammar_libs(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    vocab_sizes: Annotated[str, typer.Option(help="Comma-separated BPE vocab sizes to train and compare on.")] = "1024,8192,32000",
) -> None:
    """llguidance vs xgrammar on kvmesh's tokenizers: compile, per-token mask and advance."""
    from kvmesh.bench.grammar_libs import run_grammar_libs_bench

    result = run_grammar_libs_bench(tuple(int(v) for v in vocab_sizes.split(",") if v.strip()))
    typer.echo(json.dumps(result, indent=None if json_out else 2))


@app.command("live-belady")
def live_belady(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object.")] = False,
    rate: Annotated[float, typer.Option(min=1.0, help="Requests per second of the Mooncake-shaped traffic.")] = 1000.0,
    records: Annotated[int, typer.Option(min=100, help="Records sent through a real TRAFFIC stream (upkeep).")] = 20_000,
) -> None:
    """Live Belady's CPU share of one core (bus upkeep + periodic recompute) and its memory."""
    from kvmesh.bench.live_belady import LiveBeladyBenchConfig, run_live_belady_bench

    typer.echo(json.dumps(run_live_belady_bench(LiveBeladyBenchConfig(rate=rate, records=records)),
                          indent=None if json_out else 2))


@app.command()
def fleet(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    workers: Annotated[str, typer.Option(help="Comma-separated fleet sizes, each run on its own nats-server.")] = "100,1000",
    trace: Annotated[Path | None, typer.Option(help="Mooncake JSONL trace; default: ../shared/workloads.")] = None,
    requests: Annotated[int, typer.Option(min=2, help="Trace prefix replayed per fleet size.")] = 400,
    speed: Annotated[float, typer.Option(min=0.1, help="Replay at this multiple of the trace's timestamps.")] = 10.0,
    lookup_rate: Annotated[float, typer.Option(min=0.0, help="Extra lookup + routing probes per second.")] = 50.0,
    l1_blocks: Annotated[int, typer.Option(min=8, help="Each emulated worker's L1 capacity in blocks.")] = 256,
    churn: Annotated[int, typer.Option(min=0, help="Worker ids started and stopped (consumers left after).")] = 200,
    heartbeat_s: Annotated[float, typer.Option(min=0.2, help="Emulated workers' heartbeat interval.")] = ServiceSettings().heartbeat_interval_s,
    worker_fetch_timeout_s: Annotated[float, typer.Option(min=0.1, help="Emulated workers' idle command-consumer poll.")] = BusSettings().worker_fetch_timeout_s,
    emulator_nice: Annotated[int, typer.Option(min=0, max=19, help="Nice of the emulated fleet once the services are up (0: equal priority).")] = 10,
) -> None:
    """N emulated workers' heartbeats, KV events and commands vs the real index, eviction and router."""
    from kvmesh.bench.fleet import DEFAULT_TRACE, FleetBenchConfig, run_fleet_bench

    cfg = FleetBenchConfig(workers=tuple(int(w) for w in workers.split(",") if w.strip()), trace=trace or DEFAULT_TRACE,
                           requests=requests, speed=speed, lookup_rate=lookup_rate, l1_blocks=l1_blocks, churn=churn,
                           heartbeat_s=heartbeat_s, worker_fetch_timeout_s=worker_fetch_timeout_s,
                           emulator_nice=emulator_nice)
    typer.echo(json.dumps(run_fleet_bench(cfg), indent=None if json_out else 2))


@app.command("heartbeat-watch")
def heartbeat_watch(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object.")] = False,
    workers: Annotated[int, typer.Option(min=1, help="Worker ids whose heartbeats are written.")] = 1000,
    period_s: Annotated[float, typer.Option(min=0.05, help="Each id's heartbeat is rewritten this often (default: the keep-alive).")] = 5.0 / 3,
    window_s: Annotated[float, typer.Option(min=0.5, help="Seconds measured per layer.")] = 8.0,
) -> None:
    """CPU per heartbeat in a watching process: core subscription, ordered consumer, KV watcher, watch_workers."""
    from kvmesh.bench.heartbeat_watch import (
        HeartbeatWatchBenchConfig,
        run_heartbeat_watch_bench,
    )

    cfg = HeartbeatWatchBenchConfig(workers=workers, period_s=period_s, window_s=window_s)
    typer.echo(json.dumps(run_heartbeat_watch_bench(cfg), indent=None if json_out else 2))


@app.command("token-events")
def token_events(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object.")] = False,
    tokens: Annotated[int, typer.Option(min=2, help="Tokens generated per configuration.")] = 2000,
) -> None:
    """NATS disk writes per generated token: token events in a file stream (before), a memory stream, core NATS (now)."""
    from kvmesh.bench.token_events import TokenEventsBenchConfig, run_token_events_bench

    typer.echo(json.dumps(run_token_events_bench(TokenEventsBenchConfig(tokens=tokens)), indent=None if json_out else 2))


@app.command("l3-gc")
def l3_gc(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    objects: Annotated[str, typer.Option(help="Comma-separated bucket sizes, filled in turn.")] = "10000,100000",
    keys_per_pass: Annotated[int, typer.Option(min=1, help="Keys one listing-only pass covers.")] = 100_000,
    old_max_objects: Annotated[int, typer.Option(help="Largest size the old HEAD-per-object pass runs at.")] = 100_000,
    fill_procs: Annotated[int, typer.Option(min=1, help="Processes filling the bucket.")] = 2,
    put_threads: Annotated[int, typer.Option(min=1, help="Connections per filling process.")] = 8,
    object_bytes: Annotated[int, typer.Option(min=0, help="Body size of each object (a pass reads none).")] = 0,
) -> None:
    """One L3 GC pass on a generated weed bucket: a HEAD per object (old) vs listing-only slices (requests, s, RSS)."""
    from kvmesh.bench.l3_gc import L3GCBenchConfig, run_l3_gc_bench

    cfg = L3GCBenchConfig(objects=tuple(int(n) for n in objects.split(",") if n.strip()), keys_per_pass=keys_per_pass,
                          old_max_objects=old_max_objects, fill_procs=fill_procs, put_threads=put_threads,
                          object_bytes=object_bytes)
    typer.echo(json.dumps(run_l3_gc_bench(cfg), indent=None if json_out else 2))


@app.command()
def soak(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    duration_s: Annotated[float, typer.Option(min=10, help="How long the agent lanes run.")] = 1200.0,
    sessions: Annotated[int, typer.Option(min=1, help="Concurrent agent lanes (SWE-agent trajectories).")] = 8,
    l2_blocks: Annotated[int, typer.Option(min=1, help="L2 per worker, in blocks (smaller than the working set).")] = 2048,
    sample_every_s: Annotated[float, typer.Option(min=1, help="Seconds between two resource samples.")] = 30.0,
    warmup_s: Annotated[float, typer.Option(min=0, help="Samples before this are left out of the flatness check.")] = 300.0,
    png: Annotated[Path | None, typer.Option(help="Write a plot of fds and RSS over time here.")] = None,
    model: Annotated[Path | None, typer.Option(help="Checkpoint dir to serve; default: SmolLM2-135M-Instruct, "
                                                    "imported the way `kvmesh up` does.")] = None,
) -> None:
    """Concurrent agent sessions through `kvmesh up` for a long time: fds, RSS, threads per process; errors, DLQ."""
    from kvmesh.bench.soak import SoakConfig, run_soak

    cfg = SoakConfig(duration_s=duration_s, sessions=sessions, l2_blocks=l2_blocks, sample_every_s=sample_every_s,
                     warmup_s=warmup_s, png=png, model_dir=None if model is None else model.resolve())
    typer.echo(json.dumps(run_soak(cfg), indent=None if json_out else 2))


@app.command()
def peer(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    peer_python: Annotated[Path | None, typer.Option(help="The python of a venv with vLLM; default: this one.")] = None,
    model: Annotated[Path | None, typer.Option(help="Checkpoint dir both serve; default: SmolLM2-135M-Instruct, "
                                                    "imported into --out the way `kvmesh up` does.")] = None,
    out: Annotated[Path, typer.Option(help="Where the JSON, the PNG, vLLM's log and kvmesh's state dir go.")] = Path(".kvmesh/bench-peer"),
    sessions: Annotated[int, typer.Option(min=1, help="(a) concurrent agent sessions.")] = 8,
    calls: Annotated[int, typer.Option(min=1, help="(a) calls per agent session (fewer where the context is full).")] = 10,
    chat_users: Annotated[int, typer.Option(min=1, help="(b) chat users sharing a system prompt.")] = 6,
    chat_turns: Annotated[int, typer.Option(min=1, help="(b) turns per chat user.")] = 5,
    chat_qps: Annotated[float, typer.Option(help="(b) arrival rate of chat requests.")] = 0.6,
    long_tokens: Annotated[int, typer.Option(help="(c) the long prompt's tokens.")] = 6000,
    decode_tokens: Annotated[int, typer.Option(help="(d) answer length asked per stream.")] = 64,
    batches: Annotated[str, typer.Option(help="(d) concurrent streams per decode run, comma-separated.")] = "1,8,32",
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    engines: Annotated[str, typer.Option(help="kvmesh's engine backends to run, comma-separated: vllm, native.")] = "vllm,native",
    fleet: Annotated[bool, typer.Option(help="Instead: two vLLM servers behind round-robin against two vLLM workers "
                                             "under kvmesh (kvmesh up --engine vllm --prefill 2): agent sessions, a "
                                             "restart, their returning calls (docs/vllm.md). --peer-python's venv "
                                             "needs kvmesh too.")] = False,
    kv_cache_gib: Annotated[int | None, typer.Option(
        min=1, help="Each vLLM's KV pool in GiB, and kvmesh's (equal memory). Default: 3; 1 with --fleet.")] = None,
) -> None:
    """kvmesh against vLLM: same box, same cores, same checkpoint, same requests, one after the other (docs/peer.md)."""
    import sys

    from kvmesh.bench.peer import HOW_TO_PEER, PeerConfig, peer_version, run_peer_bench

    peer_python = peer_python or Path(sys.executable)
    if peer_version(peer_python) is None:
        typer.echo(f"{peer_python} cannot import vllm. {HOW_TO_PEER}", err=True)
        raise typer.Exit(2)
    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    if not chosen or any(e not in ("vllm", "native") for e in chosen):
        raise typer.BadParameter("--engines takes vllm, native or both, comma-separated")
    if model is None:
        from kvmesh.stack.model import default_model_dir

        model = default_model_dir(out)
    if fleet:
        from kvmesh.bench.peer_fleet import run_fleet_bench

        cfg = PeerConfig(peer_python=peer_python, model_dir=model.resolve(), out_dir=out.resolve(), sessions=sessions,
                         calls=calls, kv_cache_gib=kv_cache_gib or 1, seed=seed)
        result = run_fleet_bench(cfg, lambda line: typer.echo(f"[peer-fleet] {line}", err=True))
        typer.echo(json.dumps(result, indent=None if json_out else 2))
        return
    cfg = PeerConfig(peer_python=peer_python, model_dir=model.resolve(), out_dir=out.resolve(), sessions=sessions,
                     calls=calls, chat_users=chat_users, chat_turns=chat_turns, chat_qps=chat_qps,
                     long_tokens=long_tokens, decode_tokens=decode_tokens,
                     batches=tuple(int(b) for b in batches.split(",") if b.strip()), seed=seed, engines=chosen,
                     kv_cache_gib=kv_cache_gib or 3)
    result = run_peer_bench(cfg, lambda line: typer.echo(f"[peer] {line}", err=True))
    typer.echo(json.dumps(result, indent=None if json_out else 2))


@app.command()
def connector(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    peer_python: Annotated[Path | None, typer.Option(help="The python of a venv with vLLM and kvmesh in it; "
                                                          "default: this one.")] = None,
    model: Annotated[Path | None, typer.Option(help="Checkpoint dir; default: SmolLM2-135M-Instruct, imported into --out.")] = None,
    out: Annotated[Path, typer.Option(help="Where the JSON and vLLM's logs go.")] = Path(".kvmesh/bench-connector"),
    sessions: Annotated[int, typer.Option(min=1, help="Concurrent agent sessions.")] = 8,
    calls: Annotated[int, typer.Option(min=2, help="Calls per session; the last one is sent after the restart.")] = 10,
    kv_cache_gib: Annotated[int, typer.Option(min=1, help="vLLM's KV pool (VLLM_CPU_KVCACHE_SPACE), both runs.")] = 1,
    l2_gib: Annotated[float, typer.Option(help="kvmesh's L2 in the vLLM worker.")] = 2.0,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
) -> None:
    """vLLM alone against vLLM with kvmesh's connector: agent sessions, a restart, their returning turns."""
    import subprocess
    import sys

    from kvmesh.bench.connector import run_connector_bench
    from kvmesh.bench.peer import PeerConfig

    peer_python = peer_python or Path(sys.executable)
    probe = "import vllm, kvmesh.connectors.vllm.connector"
    try:
        usable = subprocess.run([str(peer_python), "-c", probe], capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        usable = False
    if not usable:
        typer.echo(f"kvmesh bench connector needs a Python with vLLM and kvmesh: {peer_python} lacks one "
                   "(bash install.sh puts vLLM in kvmesh's venv; or name another with --peer-python)", err=True)
        raise typer.Exit(2)
    if model is None:
        from kvmesh.stack.model import default_model_dir

        model = default_model_dir(out)
    cfg = PeerConfig(peer_python=peer_python, model_dir=model.resolve(), out_dir=out.resolve(), sessions=sessions,
                     calls=calls, kv_cache_gib=kv_cache_gib, seed=seed)
    result = run_connector_bench(cfg, int(l2_gib * 2**30), lambda line: typer.echo(f"[connector] {line}", err=True))
    typer.echo(json.dumps(result, indent=None if json_out else 2))


@app.command()
def handoff(
    json_out: Annotated[bool, typer.Option("--json", help="Print only the JSON object (progress still on stderr).")] = False,
    geometry: Annotated[str, typer.Option(help="KV geometry: 8b (Llama-3-8B) or 70b (Llama-3-70B).")] = "8b",
    turns: Annotated[int, typer.Option(min=1, help="Turns of the recorded agent session.")] = 4,
    min_first_tokens: Annotated[int, typer.Option(min=16, help="The session's first call has at least this many tokens.")] = 2000,
    l3: Annotated[str, typer.Option(help="Stacks to run, comma-separated: on (S3 uploads beside the handoff), off.")] = "on,off",
    mfu: Annotated[float, typer.Option(help="Model FLOPs utilization of the modeled H200 recompute.")] = 0.5,
    out: Annotated[Path | None, typer.Option(help="Keep each stack's state dir (logs) and handoff.json here.")] = None,
) -> None:
    """The prefill -> decode handoff through `kvmesh up` at real KV geometry: gap, GB/s, memcpy, H200 recompute."""
    from kvmesh.bench.handoff import HandoffConfig, run_handoff_bench
    from kvmesh.sim.recompute_model import GEOMETRIES

    if geometry not in GEOMETRIES:
        raise typer.BadParameter(f"unknown geometry {geometry!r} (choose from {', '.join(GEOMETRIES)})")
    modes = [m.strip() for m in l3.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise typer.BadParameter("--l3 takes on, off or on,off")
    cfg = HandoffConfig(geometry=geometry, turns=turns, min_first_tokens=min_first_tokens, mfu=mfu,
                        l3_modes=tuple(m == "on" for m in modes),
                        out_dir=out.resolve() if out else None)
    result = run_handoff_bench(cfg, lambda line: typer.echo(f"[handoff] {line}", err=True))
    typer.echo(json.dumps(result, indent=None if json_out else 2))
