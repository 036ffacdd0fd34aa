"""`kvmesh bench soak`: a long concurrent agent load through `kvmesh up`, watching every process's resources.

The product path: one stack started with `kvmesh up` (the default model and
settings, NATS users on), an L2 smaller than the working set so that it
evicts all along, and `sessions` agent lanes replaying SWE-agent
trajectories (bench/agent_workload.py) as OpenAI tool-calling loops with the
recorded tool time between calls. A lane that finishes a trajectory starts
the next one under a new session id, until `duration_s` ends.

Every `sample_every_s` the bench reads, for each process of the stack
(services, nats-server, weed): open fds, RSS, threads and memory mappings,
from /proc. At the end it reads the ingress's retries (a worker silent past
its timeout: prefill retried or decode migrated), what each JetStream stream
holds (DEAD_LETTER's messages among them) and the blocks L2 evicted (it
must, for the run to count).

Two judgements of the samples after `warmup_s`, per process:
- `flat` (the target): every sample's fds within ±5% of their median, RSS
  within ±10%;
- `no_growth` (a leak test): the median of the second half of those samples
  is within 5% (fds; at least 2 fds) and 10% (RSS, mappings) of the first
  half's. A process whose RSS swings with its batches but does not grow is
  `no_growth` without being `flat`.
`target_met`: every process flat, L2 evicted, and `errors`, `dead_letters`
and `retries` all 0. A PNG of fds and RSS over time goes next
to `--png` when matplotlib is installed (the bench extra).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvmesh.bench.agent_workload import AgentSession, build_agent_workload
from kvmesh.bench.serve import (
    KEY,
    REPO_ROOT,
    ServeBenchConfig,
    running_stack,
    stack_metric_families,
    stream_chat,
)
from kvmesh.protocol.streams import DEAD_LETTER
from rich.console import Console

FDS_BAND, RSS_BAND = 0.05, 0.10  # the targets: fds within ±5% of their median after warm-up, RSS ±10%
BLOCK_SIZE = 16  # tokens per KV block
CONTEXT_ROOM = 64  # tokens kept free beside the answer when a session is fitted to the context
FDS_SLACK = 2  # a growth test's floor: a request's sockets come and go


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration_s: float = 1200.0
    sessions: int = 8  # concurrent agent lanes
    max_steps: int = 10  # calls per trajectory after the first
    max_tokens: int = 8
    l2_blocks: int = 2048  # per worker: smaller than the lanes' contexts together, so L2 evicts
    sample_every_s: float = 30.0
    warmup_s: float = 300.0
    seed: int = 0
    png: Path | None = None
    model_dir: Path | None = None  # None: the default real model (SmolLM2-135M-Instruct), imported as `kvmesh up` does


def _proc(pid: int) -> dict | None:
    """fds, RSS (and its anonymous and shared-memory parts: L2's slab), threads and mappings, or None when gone."""
    base = Path(f"/proc/{pid}")
    try:
        status = dict(line.split(":", 1) for line in (base / "status").read_text().splitlines() if ":" in line)
        fds = len(os.listdir(base / "fd"))
        maps = sum(1 for _ in (base / "maps").open())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    mb = {k: round(int(status[k].split()[0]) / 1024, 1) for k in ("VmRSS", "RssAnon", "RssShmem")}
    return {"fds": fds, "rss_mb": mb["VmRSS"], "rss_anon_mb": mb["RssAnon"], "rss_shmem_mb": mb["RssShmem"],
            "threads": int(status["Threads"]), "maps": maps}


def _processes(state_dir: Path) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in json.loads((state_dir / "stack.json").read_text())["processes"]}


def _band(values: list[float]) -> float:
    """The largest deviation from the median, as a share of it."""
    mid = statistics.median(values)
    return max(abs(v - mid) for v in values) / mid if mid else 0.0


def _drift(values: list[float]) -> float:
    """How far the median of the second half moved from the first half's, as a share of it."""
    half = len(values) // 2
    first, second = statistics.median(values[:half]), statistics.median(values[half:])
    return abs(second - first) / first if first else 0.0


def judge(samples: list[dict], warmup_s: float) -> dict:
    """Per process after warm-up: how far fds, RSS and mappings strayed and drifted; `flat` and `no_growth`."""
    late = [s for s in samples if s["t_s"] >= warmup_s]
    out: dict = {}
    for name in sorted({n for s in late for n in s["procs"]}):
        seen = [s["procs"][name] for s in late if s["procs"].get(name)]
        if len(seen) < 2:
            continue
        fds, rss, maps = ([p[k] for p in seen] for k in ("fds", "rss_mb", "maps"))
        row = {"fds_band": round(_band(fds), 4), "rss_band": round(_band(rss), 4),
               "fds_drift": round(_drift(fds), 4), "rss_drift": round(_drift(rss), 4),
               "maps_drift": round(_drift(maps), 4), "fds_max": max(fds), "rss_mb_max": max(rss),
               "maps_max": max(maps), "threads_max": max(p["threads"] for p in seen)}
        fds_room = max(FDS_BAND, FDS_SLACK / max(1, statistics.median(fds[:len(fds) // 2])))
        row["flat"] = row["fds_band"] <= FDS_BAND and row["rss_band"] <= RSS_BAND
        row["no_growth"] = (row["fds_drift"] <= fds_room and row["rss_drift"] <= RSS_BAND
                            and row["maps_drift"] <= RSS_BAND)
        out[name] = row
    return out


async def _drive(base_url: str, model: str, sessions: list[AgentSession], tools: list[dict], cfg: SoakConfig,
                 state_dir: Path, say: Console) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=600)
    t0 = time.monotonic()
    end = t0 + cfg.duration_s
    calls = cached = prompt = 0
    errors: list[str] = []
    samples: list[dict] = []

    async def lane(i: int) -> None:
        nonlocal calls, cached, prompt
        run = 0
        while time.monotonic() < end:
            s = sessions[(i + run * cfg.sessions) % len(sessions)]
            name = f"{s.name}-lane{i}-run{run}"
            for k in range(len(s.steps) + 1):
                if time.monotonic() >= end:
                    return
                try:
                    got = await stream_chat(client, model, s.messages(k), tools, cfg.max_tokens,
                                            extra_headers={"x-session-id": name})
                except openai.APIError as exc:
                    errors.append(f"{name} call {k}: {exc}")
                    say.log(f"error: {name} call {k}: {exc}", highlight=False)
                else:
                    calls, cached, prompt = calls + 1, cached + got.cached_tokens, prompt + got.prompt_tokens
                if k < len(s.steps):
                    await asyncio.sleep(s.steps[k].tool_s)
            run += 1

    async def sampler() -> None:
        while True:
            t = time.monotonic() - t0
            procs = {name: _proc(pid) for name, pid in _processes(state_dir).items()}
            samples.append({"t_s": round(t, 1), "calls": calls, "procs": procs})
            fds = sum(p["fds"] for p in procs.values() if p)
            say.log(f"{t:6.0f} s: {calls} calls, {len(errors)} errors, fds {fds}, "
                    f"rss {sum(p['rss_mb'] for p in procs.values() if p):.0f} MB", highlight=False)
            if time.monotonic() >= end:
                return
            await asyncio.sleep(min(cfg.sample_every_s, max(0.0, end - time.monotonic())))

    watch = asyncio.create_task(sampler())
    await asyncio.gather(*(lane(i) for i in range(cfg.sessions)))
    await watch
    await client.close()
    return {"calls": calls, "errors": len(errors), "error_samples": errors[:10],
            "cached_token_ratio": round(cached / max(1, prompt), 4), "samples": samples}


async def _streams(state_dir: Path) -> dict[str, dict]:
    """What each JetStream stream holds at the end (messages, bytes): what nats-server keeps for the run."""
    import nats
    from kvmesh.bus.client_auth import connect_kwargs
    from kvmesh.credentials.nats import admin_auth

    url = json.loads((state_dir / "stack.json").read_text())["nats_url"]
    nc = await nats.connect(**connect_kwargs(url, admin_auth(state_dir)))
    try:
        return {info.config.name: {"messages": info.state.messages, "bytes": info.state.bytes}
                for info in await nc.jetstream().streams_info()}
    finally:
        await nc.close()


def _log_entries(path: Path, needle: str):
    """The JSON log lines of `path` that contain `needle`."""
    for line in path.read_text(errors="replace").splitlines():
        if needle in line:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def retry_reasons(log_dir: Path) -> list[dict]:
    """Every retry the ingress logged ("retrying request": which request, at which stage, why), so a run that
    misses the 0-retries target says what its retries were; each with its `trail`, what every service
    logged about that request, in time order."""
    found = [{k: entry.get(k) for k in ("timestamp", "request_id", "stage", "attempt", "reason")}
             for path in sorted(log_dir.glob("ingress-*.log"))
             for entry in _log_entries(path, '"retrying request"')]
    for retry in found:
        trail = [{"log": path.stem, **{k: v for k, v in entry.items() if k not in ("request_id", "level")}}
                 for path in sorted(log_dir.glob("*.log"))
                 for entry in _log_entries(path, f'"{retry["request_id"]}"')]
        retry["trail"] = sorted(trail, key=lambda e: str(e.get("timestamp")))
    return found


def _counter(state_dir: Path, family_name: str, **labels: str) -> float:
    """A counter summed over every service of the stack (and over the labels not named)."""
    return sum(s.value for family in stack_metric_families(state_dir) if family.name == family_name
               for s in family.samples
               if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def _plot(samples: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = sorted({n for s in samples for n in s["procs"]})
    fig, (ax_fd, ax_rss) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name in names:
        pts = [(s["t_s"] / 60, s["procs"][name]) for s in samples if s["procs"].get(name)]
        ax_fd.plot([t for t, _ in pts], [p["fds"] for _, p in pts], label=name)
        ax_rss.plot([t for t, _ in pts], [p["rss_mb"] for _, p in pts], label=name)
    ax_fd.set_ylabel("open fds")
    ax_rss.set_ylabel("RSS (MB)")
    ax_rss.set_xlabel("minutes")
    ax_fd.legend(fontsize=7, ncol=3)
    ax_fd.set_title("kvmesh bench soak: every process of the stack")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def fit_to_context(sessions: Sequence[AgentSession], tools: list[dict], model_dir: Path, max_tokens: int
                   ) -> tuple[list[AgentSession], int]:
    """Each session cut before its first call whose prompt (the model's chat template, tools included) would
    leave less than the answer and CONTEXT_ROOM of the context; also how many calls were cut."""
    from kvmesh.engine.checkpoint import read_json
    from kvmesh.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    context = int(read_json(model_dir / "config.json")["max_position_embeddings"])
    fitted, cut = [], 0
    for s in sessions:
        keep = 0
        while keep < len(s.steps) and (len(tok.encode(tok.apply_chat_template(s.messages(keep + 1), tools)))
                                       + max_tokens + CONTEXT_ROOM <= context):
            keep += 1
        cut += len(s.steps) - keep
        fitted.append(replace(s, steps=s.steps[:keep]))
    return fitted, cut


def _block_bytes(model_dir: Path, block_size: int) -> int:
    from kvmesh.engine.checkpoint import read_json
    from kvmesh.engine.model_config import parse_model_config

    return parse_model_config(read_json(model_dir / "config.json")).kv_bytes_per_token() * block_size


def run_soak(cfg: SoakConfig) -> dict:
    import tempfile

    from kvmesh.stack.model import default_model_dir

    say = Console(stderr=True)
    w = build_agent_workload(REPO_ROOT, cfg.sessions * 2, seed=cfg.seed, max_steps=cfg.max_steps)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-soak-") as tmp:
        model_dir = cfg.model_dir or default_model_dir(Path(tmp))
        sessions, cut = fit_to_context(w.sessions, w.tools, model_dir, cfg.max_tokens)
        result: dict = {"config": {"duration_s": cfg.duration_s, "sessions": cfg.sessions, "l2_blocks": cfg.l2_blocks,
                                   "model": model_dir.name, "sample_every_s": cfg.sample_every_s,
                                   "warmup_s": cfg.warmup_s, "calls_cut_to_fit_context": cut}}
        state_dir = Path(tmp) / "stack"
        state_dir.mkdir()
        env = {"KVMESH_ENGINE__BLOCK_SIZE": str(BLOCK_SIZE),
               "KVMESH_TIERS__L2_CAPACITY_BYTES": str(cfg.l2_blocks * _block_bytes(model_dir, BLOCK_SIZE))}
        with running_stack(model_dir, ServeBenchConfig(model_dir=model_dir), True, say, env, state_dir) as url:
            say.log(f"soak: {cfg.sessions} lanes for {cfg.duration_s:.0f} s on {model_dir.name}")
            result |= asyncio.run(_drive(url, model_dir.name, sessions, w.tools, cfg, state_dir, say))
            result["streams"] = asyncio.run(_streams(state_dir))
            result["dead_letters"] = result["streams"].get(DEAD_LETTER.name, {}).get("messages", 0)
            result["retries"] = _counter(state_dir, "kvmesh_ingress_retries")
            result["retry_reasons"] = retry_reasons(state_dir / "logs")
            result["l2_evicted_blocks"] = _counter(state_dir, "kvmesh_local_evicted_blocks", tier="l2",
                                                   reason="capacity")
    result["processes"] = judge(result["samples"], cfg.warmup_s)
    result["flat"] = bool(result["processes"]) and all(p["flat"] for p in result["processes"].values())
    result["no_growth"] = bool(result["processes"]) and all(p["no_growth"] for p in result["processes"].values())
    result["target_met"] = (result["flat"] and result["l2_evicted_blocks"] > 0
                            and not (result["errors"] or result["dead_letters"] or result["retries"]))
    if cfg.png is not None and _plot(result["samples"], cfg.png):
        result["png"] = str(cfg.png)
    return result
