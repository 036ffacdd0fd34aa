"""`kvmesh bench peer`: kvmesh against vLLM on the same box, the same checkpoint, one after the other.

What a user would run instead of kvmesh is one vLLM server with prefix caching. Both serve the same
HF-format checkpoint dir (by default SmolLM2-135M-Instruct as `kvmesh up` imports it) and get the same
requests (bench/peer_workloads.py), driven by the same client code (bench/peer_drive.py). They never run
at once: vLLM first (started by PID from `--peer-python`, by default this Python), then a kvmesh stack
through `kvmesh up` per engine (`--engines`: vllm, kvmesh's default, and native, its own engine), each
fresh, each on the whole box.

Equal compute: every vLLM, the peer's and kvmesh's workers', binds its engine to every core this process
may use and reserves none (shared/workers/vllm_cores.py; vLLM's own default reserves one core of two for
plain vLLM and none for one with a KV connector). What each side ran on is read back from the running
processes (vLLM's "core ids" log line, /proc's Cpus_allowed_list) into the JSON's `compute`. `kvmesh up`
decodes each request on its prefill worker (one box: a handoff frees no compute).

Equal memory: kvmesh's pool gets the bytes of vLLM's (`kv_cache_gib`), in its own block size; kvmesh's L2
comes on top (both in `memory`). Where the time goes: the CPU seconds every process of each side used
while the workloads ran (`cpu_seconds_during_workloads`: on a box the engines keep busy, what kvmesh's
processes use beside the engine is what it costs).

Out: one JSON object (per workload, per system: TTFT p50/p90/p99/mean, requests/s, decode tok/s,
cached/prompt, errors; then kvmesh/vLLM ratios per engine, above 1 meaning kvmesh is slower), the kvmesh
per-request breakdown (bench/peer_breakdown.py), and a PNG of the TTFT distributions.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bench import peer_workloads as wl
from kvmesh.bench.peer_breakdown import breakdown
from kvmesh.bench.peer_drive import Timing, run_open_loop, run_sessions, send, summary
from kvmesh.stack.procs import allowed_cpus, cpu_seconds, descendants
from kvmesh.stack.state import ProcessRecord, load_state
from kvmesh.workers.vllm_cores import allowed_cores, bind_env, logged_binding

REPO = Path(__file__).resolve().parents[1]
VLLM_READY_S = 900.0
VLLM_BLOCK, ENGINE_BLOCK = 32, 16  # kvmesh's block size with vLLM as its engine (its CPU page packing), and native
HOW_TO_PEER = ("kvmesh bench peer needs a Python with vLLM to compare against: kvmesh's own venv has it after "
               "`bash install.sh`; another one is named with --peer-python")


@dataclass(frozen=True, slots=True)
class PeerConfig:
    peer_python: Path
    model_dir: Path
    out_dir: Path
    sessions: int = 8
    calls: int = 10
    agent_max_tokens: int = 32
    chat_users: int = 6
    chat_turns: int = 5
    chat_qps: float = 0.6
    chat_max_tokens: int = 32
    long_tokens: int = 6000
    decode_tokens: int = 64
    batches: tuple[int, ...] = (1, 8, 32)
    kv_cache_gib: int = 3
    seed: int = 0
    engines: tuple[str, ...] = ("vllm", "native")  # kvmesh's engine backends to run, one stack each


def peer_version(python: Path) -> str | None:
    """vLLM's version in that interpreter, None when it has none."""
    try:
        got = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return got.stdout.strip().splitlines()[-1] if got.returncode == 0 and got.stdout.strip() else None


def build_workloads(cfg: PeerConfig) -> wl.Workloads:
    from kvmesh.engine.checkpoint import read_json
    from kvmesh.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(cfg.model_dir)
    context = int(read_json(cfg.model_dir / "config.json")["max_position_embeddings"])

    def tokens(messages: list[dict]) -> int:
        return len(tok.encode(tok.apply_chat_template(messages)))

    sessions, cut = wl.agent_sessions(REPO, cfg.sessions, cfg.calls, cfg.agent_max_tokens, context, tokens, cfg.seed)
    return wl.Workloads(
        agents=sessions,
        chat=wl.chat_requests(cfg.chat_users, cfg.chat_turns, cfg.chat_qps, cfg.chat_max_tokens, cfg.seed),
        long=wl.long_prompt(tokens, cfg.long_tokens, 16, cfg.seed),
        decode=wl.decode_batches(cfg.batches, cfg.decode_tokens),
        notes={"context": context, "agent_calls": sum(len(s.calls) for s in sessions),
               "agent_calls_cut_to_fit_context": cut,
               "agent_replay": "recorded history; tool calls as text (the model's template has no tool syntax)"})


async def drive(base_url: str, api_key: str, model: str, w: wl.Workloads, say: Callable[[str], None]) -> dict:
    """Every workload in a fixed order against one server: timings and wall seconds per workload."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    runs: dict[str, tuple[list[Timing], float]] = {}

    async def timed(name: str, work) -> None:
        start = time.monotonic()
        got = await work
        runs[name] = (got, time.monotonic() - start)
        s = summary(got, runs[name][1])
        say(f"{name}: {s['requests']} requests, {s['errors']} errors, TTFT mean {s['ttft_s']['mean']} s")

    cold = await send(client, model, "long_cold", w.long)
    warm = await send(client, model, "long_warm", w.long)
    runs["long_cold"], runs["long_warm"] = ([cold], 0.0), ([warm], 0.0)
    say(f"long prompt: cold TTFT {cold.ttft_s if cold.ok else cold.error}, warm {warm.ttft_s if warm.ok else warm.error}")
    for batch, calls in w.decode.items():
        await timed(f"decode_b{batch}", asyncio.gather(*(send(client, model, f"decode_b{batch}", c) for c in calls)))
    await timed("chat", run_open_loop(client, model, "chat", w.chat))
    await timed("agents", run_sessions(client, model, w.agents, say))
    await client.close()
    return runs


@contextmanager
def vllm_server(cfg: PeerConfig, port: int, say: Callable[[str], None], extra_args: tuple[str, ...] = (),
                extra_env: dict[str, str] | None = None, log_name: str = "vllm.log") -> Iterator[tuple[Path, int]]:
    """vLLM's OpenAI server on the checkpoint, on every core this process may use (none reserved), started
    and stopped by PID; yields its log path and PID."""
    import httpx

    log = cfg.out_dir / log_name
    env = {**os.environ, **bind_env(allowed_cores()), "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
           **(extra_env or {})}
    argv = [str(cfg.peer_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(cfg.model_dir),
            "--served-model-name", cfg.model_dir.name, "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + VLLM_READY_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {proc.returncode} while starting:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM not ready within {VLLM_READY_S:.0f}s")
            time.sleep(2)
        say("vLLM ready")
        yield log, proc.pid
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def _ratio(ours, theirs) -> float | None:
    return round(ours / theirs, 3) if isinstance(ours, int | float) and isinstance(theirs, int | float) and theirs else None


def compare(ours: dict, theirs: dict) -> dict:
    """kvmesh / vLLM for the TTFTs (above 1: kvmesh slower); vLLM / kvmesh would be the speed-up."""
    return {k: _ratio(ours["ttft_s"][k], theirs["ttft_s"][k]) for k in ("p50", "p90", "p99", "mean")} | {
        "requests_per_s": _ratio(ours["requests_per_s"], theirs["requests_per_s"]),
        "decode_tok_s_per_stream": _ratio(ours["decode_tok_s_per_stream"], theirs["decode_tok_s_per_stream"]),
        "output_tok_s": _ratio(ours["output_tok_s"], theirs["output_tok_s"])}


def plot(ttfts: dict[str, dict[str, list[float]]], path: Path) -> None:
    """Step CDFs of TTFT per workload with at least 5 requests, both systems on each panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, sides in ttfts.items() if min(len(v) for v in sides.values()) >= 5]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for system, style in zip(ttfts[name], ("-", "--", ":"), strict=False):
            xs = ttfts[name][system]
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, where="post", label=system)
        ax.set_title(f"{name} ({len(ttfts[name]['vllm'])} requests)")
        ax.set_xlabel("TTFT (s)")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share of requests")
    axes[0][0].legend()
    fig.suptitle("TTFT: vLLM and kvmesh (per engine), same box, cores and checkpoint, one after the other",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kv_bytes_per_token(cfg: PeerConfig) -> int:
    """The model's KV bytes per token in float32, as every side serves it."""
    from kvmesh.engine.checkpoint import read_json
    from kvmesh.engine.model_config import parse_model_config

    return parse_model_config(read_json(cfg.model_dir / "config.json"), dtype="float32").kv_bytes_per_token()


def pool_blocks(cfg: PeerConfig, block_size: int) -> int:
    """kvmesh's pool in blocks of `block_size`: the bytes vLLM alone gets (`kv_cache_gib`)."""
    return cfg.kv_cache_gib * 1024**3 // (kv_bytes_per_token(cfg) * block_size)


def vllm_compute(log: Path, pid: int | None = None) -> dict:
    """What a vLLM ran on, read back: the cores its log says it bound its engine to and reserved, and (while it
    runs) the cores its processes may use."""
    got: dict = {"binding": logged_binding(log.read_text(errors="replace")) if log.exists() else None}
    if pid is not None:
        got["cpus_allowed"] = {str(p): allowed_cpus(p) for p in [pid, *descendants(pid)]}
    return got


def stack_processes(state_dir: Path) -> list[ProcessRecord]:
    """Every process a running kvmesh stack's state file records (servers and services)."""
    state = load_state(state_dir)
    if state is None:
        raise RuntimeError(f"no kvmesh stack is recorded in {state_dir}")
    return state.processes


def stack_pids(state_dir: Path) -> dict[str, int]:
    """The pid of every process of a running kvmesh stack, by name."""
    return {rec.name: rec.pid for rec in stack_processes(state_dir)}


def cpu_used(pids: dict[str, int], work: Callable[[], object]) -> tuple[object, dict[str, float]]:
    """Run `work`; its result and the CPU seconds each process (with what it started) used meanwhile."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    got = work()
    used = {name: round(cpu_seconds(pid) - before[name], 2) for name, pid in pids.items()}
    return got, {**used, "total": round(sum(used.values()), 2)}


def stack_compute(state_dir: Path) -> dict:
    """What a kvmesh stack's workers ran on, read back while it runs: each process's allowed cores and, for a
    vLLM worker, its engine's binding from its log."""
    out = {}
    for rec in stack_processes(state_dir):
        if rec.kind != "service":
            continue
        log = Path(rec.log)
        binding = logged_binding(log.read_text(errors="replace")) if log.exists() else None
        out[rec.name] = {"cpus_allowed": allowed_cpus(rec.pid), "children": len(descendants(rec.pid)),
                         **({"vllm_binding": binding} if binding else {})}
    return out


def run_peer_bench(cfg: PeerConfig, say: Callable[[str], None]) -> dict:
    from dataclasses import replace

    from kvmesh.bench.serve import KEY, SayLog, ServeBenchConfig, running_stack
    from kvmesh.config import TierSettings
    from kvmesh.net import free_port

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    w = build_workloads(cfg)
    say(f"workloads: {w.notes}")
    runs: dict[str, dict] = {}
    compute: dict[str, dict] = {"cpus": os.cpu_count(), "bench_cpus_allowed": allowed_cpus(os.getpid())}
    cpu: dict[str, dict] = {}  # CPU seconds each side's processes used while the workloads ran
    port = free_port()
    say("starting vLLM (about 2 minutes to load)")
    with vllm_server(cfg, port, say) as (vlog, pid):
        compute["vllm"] = vllm_compute(vlog, pid)
        runs["vllm"], cpu["vllm"] = cpu_used({"vllm": pid}, lambda: asyncio.run(
            drive(f"http://127.0.0.1:{port}/v1", "none", cfg.model_dir.name, w, say)))
    parts: dict[str, dict] = {}
    memory: dict[str, dict] = {"vllm": {"pool_bytes": cfg.kv_cache_gib * 1024**3}}
    systems = ["vllm"]
    for engine in cfg.engines:
        system = f"kvmesh_{engine}"
        systems.append(system)
        state_dir = cfg.out_dir / f"kvmesh-state-{engine}"
        block = VLLM_BLOCK if engine == "vllm" else ENGINE_BLOCK
        env = {"KVMESH_LOG_LEVEL": "info", "KVMESH_INGRESS__FIRST_TOKEN_TIMEOUT_S": "600",
               "KVMESH_ENGINE__BLOCK_SIZE": str(block), "KVMESH_ENGINE__NUM_BLOCKS": str(pool_blocks(cfg, block))}
        memory[system] = {"pool_bytes": pool_blocks(cfg, block) * block * kv_bytes_per_token(cfg),
                          "l2_capacity_bytes": TierSettings().l2_capacity_bytes}
        # vLLM workers decode their own requests (`kvmesh up` starts no vLLM decode worker); the native engine
        # keeps its decode worker, which takes requests over only if the prefill worker fails
        serve_cfg = replace(ServeBenchConfig(model_dir=cfg.model_dir), engine=engine,
                            decode=0 if engine == "vllm" else 1)
        with running_stack(cfg.model_dir, serve_cfg, True, SayLog(say), env, state_dir) as url:
            say(f"kvmesh ({engine} engine) ready")
            compute[system] = stack_compute(state_dir)
            runs[system], cpu[system] = cpu_used(stack_pids(state_dir), lambda: asyncio.run(
                drive(url, KEY, cfg.model_dir.name, w, say)))
            parts[system] = breakdown([t for timings, _ in runs[system].values() for t in timings], state_dir / "logs")
    result: dict = {"bench": "peer", "model": cfg.model_dir.name, "workload_notes": w.notes, "compute": compute,
                    "memory": memory, "cpu_seconds_during_workloads": cpu,
                    "vllm_version": peer_version(cfg.peer_python), "workloads": {}, "kvmesh_breakdown": parts}
    for name in runs["vllm"]:
        if name.startswith("long_"):  # one request each
            one = {s: runs[s][name][0][0] for s in systems}
            sides = {s: {"ttft_s": round(t.ttft_s, 4) if t.ok else None, "prompt_tokens": t.prompt_tokens,
                         "cached_tokens": t.cached_tokens, "error": t.error} for s, t in one.items()}
            result["workloads"][name] = {**sides, **{f"ttft_{s}_over_vllm": _ratio(sides[s]["ttft_s"],
                                                                                    sides["vllm"]["ttft_s"])
                                                     for s in systems[1:]}}
        else:
            sides = {s: summary(*runs[s][name]) for s in systems}
            result["workloads"][name] = {**sides, **{f"{s}_over_vllm": compare(sides[s], sides["vllm"])
                                                     for s in systems[1:]}}
    ttfts = {name: {s: sorted(round(t.ttft_s, 4) for t in runs[s][name][0] if t.ok) for s in systems}
             for name in runs["vllm"]}
    result["ttft_s_sorted"] = ttfts  # every request's TTFT, for other plots
    png = cfg.out_dir / "peer_ttft.png"
    plot(ttfts, png)
    result["plot"] = str(png)
    (cfg.out_dir / "peer.json").write_text(json.dumps(result, indent=2))
    return result
