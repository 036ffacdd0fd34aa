"""`kvmesh bench serve`: a multi-turn agent workload through the `openai` SDK on kvmesh, on the engines'
own prefix cache alone, and with no cache, one run.

For each mode (bench/serve_modes.py: `kvmesh`, `l1_only`, `cache_off`) the bench starts
its own stack (`kvmesh up --detach` in a temp state dir, free ports, the mode's
settings), drives the workload (bench/serve_workload.py) at a fixed concurrency
(sessions in parallel, turns of a session in order, greedy, streaming with usage),
reads what the stack's metrics say it did (`stack`, bench/serve_evidence.py) and
stops the stack. Figures per mode: TTFT mean/p50/p99, TPOT p50, output tokens/s,
requests/s, cached-token ratio. The headline is `kvmesh_vs_l1_only`: kvmesh's
figures over the L1-only mode's, what users get from vLLM/SGLang for free;
`cache_off` stays as a reference row (bench/serve_compare.py). `answers_identical`
compares each mode's answers with kvmesh's, request by request.
`service_overhead_ms_p50` (bench/serve_overhead.py): in the kvmesh mode, a few extra
sessions run one request at a time through the services and through an in-process
engine (same prompt ids, same cache state), TTFT difference per request; the answers
must be identical (`overhead_identical`); `service_overhead_ms_p50_full_hit` sends
each of those requests a second time (the hops alone). Progress on stderr, one JSON
object.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from kvmesh.bench.serve_workload import Session, Workload
from rich.console import Console

REPO_ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-bench-serve"


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    model_dir: Path | None = None  # None: the `preset` in a temp dir
    preset: str = "tiny"
    concurrency: int = 4
    sessions: int = 8
    turns: int = 4
    max_tokens: int = 16
    overhead_sessions: int = 2
    prefill: int = 1
    decode: int = 1
    l3: bool = True  # False: workers without the S3 tier (shows what L3 lookups on a miss cost)
    l1_blocks: int | None = None  # each engine's KV pool, in blocks (None: the engine's default)
    engine: str = "native"  # the workers' engine backend (kvmesh up --engine): these benches time kvmesh's own path


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str
    key: str = ""  # which request of the workload: session/turn (set by `drive`)


class SayLog:
    """`running_stack` reports through a rich Console's `log`: this sends it to a bench's progress function."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say

    def log(self, text: str) -> None:
        self._say(text)


def stack_env(cfg: ServeBenchConfig, cache: bool, port: int,
              extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings every service of a bench stack gets, on top of this process's environment."""
    env = {"KVMESH_API_KEYS": f"{KEY}:bench", "KVMESH_INGRESS__PORT": str(port),
           "KVMESH_ENGINE__ENABLE_PREFIX_CACHING": "true" if cache else "false", "KVMESH_LOG_LEVEL": "warning",
           "KVMESH_INGRESS__RATE_LIMIT_PER_S": "1000", "KVMESH_INGRESS__RATE_LIMIT_BURST": "1000",
           # cache off: no L3 either, so the baseline pays no lookups for blocks it may not use
           "KVMESH_TIERS__L3_ENABLED": "true" if cfg.l3 and cache else "false"}
    if cfg.l1_blocks is not None:
        env["KVMESH_ENGINE__NUM_BLOCKS"] = str(cfg.l1_blocks)
    return {**env, **(extra_env or {})}


@contextmanager
def running_stack(model_dir: Path, cfg: ServeBenchConfig, cache: bool, say: Console,
                  extra_env: dict[str, str] | None = None, state_dir: Path | None = None) -> Iterator[str]:
    """A stack of our own in a temp state dir; yields the ingress base URL; always `kvmesh down`.

    `extra_env` adds settings (`KVMESH_...`) for every service of the stack; `state_dir` (instead
    of a temp dir) lets the caller read the stack's state file (`stack.json`: every endpoint)."""
    from kvmesh.net import free_port

    kvmesh = str(Path(sys.executable).parent / "kvmesh")
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-serve-") as scratch:
        tmp = str(state_dir or scratch)
        port = free_port()
        env = {**os.environ, **stack_env(cfg, cache, port, extra_env)}
        args = [kvmesh, "up", "--detach", "--model", str(model_dir), "--state-dir", tmp, "--nats-port", "0",
                "--nats-monitor-port", "0", "--s3-port", "0", "--prefill", str(cfg.prefill),
                "--decode", str(cfg.decode), "--engine", cfg.engine, "--timeout", "900"]
        say.log(f"starting a stack (prefix cache {'on' if cache else 'off'})")
        try:
            up = subprocess.run(args, env=env, capture_output=True, text=True, timeout=960)
            if up.returncode != 0:  # the state dir goes with the stack: keep the end of the log `up` names
                named = re.search(r"\(log: (\S+)\)", up.stderr)
                path = Path(named.group(1)) if named else None
                log = path.read_text(errors="replace")[-1500:] if path and path.exists() else ""
                raise RuntimeError(f"kvmesh up failed ({up.returncode}): {up.stderr[-2000:]}{log}")
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            subprocess.run([kvmesh, "down", "--state-dir", tmp], env=env, capture_output=True, timeout=120)


def stack_metrics_by_service(state_dir: Path) -> Iterator[tuple[str, object]]:
    """(endpoint name, metric family) for every kvmesh service in a stack's state file (servers' consoles are
    skipped)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for ep in json.loads((state_dir / "stack.json").read_text())["endpoints"]:
        if not ep["url"].startswith("http://") or ep["check"] != "http":
            continue
        reply = httpx.get(f"{ep['url']}/metrics", timeout=10)
        if reply.status_code != 200:  # not a kvmesh service (a server's console)
            continue
        for family in text_string_to_metric_families(reply.text):
            yield ep["name"], family


def stack_metric_families(state_dir: Path) -> Iterator:
    """Every metric family of every kvmesh service in a stack's state file (servers' consoles are skipped)."""
    for _, family in stack_metrics_by_service(state_dir):
        yield family


async def stream_chat(client, model: str, messages: list[dict], tools: list[dict], max_tokens: int,
                      **extra) -> Sample:
    """One greedy streaming chat completion with usage; `extra` goes to the SDK call (session routing)."""
    started = time.perf_counter()
    first = None
    parts: list[str] = []
    usage = None
    stream = await client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, **extra)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                parts.append(choice.delta.content)
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError("stream ended without usage")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Sample((first or end) - started, end - started, usage.prompt_tokens, cached or 0,
                  usage.completion_tokens, "".join(parts))


async def one_request(client, model: str, messages: list[dict], tools: list[dict], max_tokens: int,
                      session: str) -> Sample:
    return await stream_chat(client, model, messages, tools, max_tokens, prompt_cache_key=session)


def messages_of(w: Workload) -> list[dict]:
    return [{"role": "system", "content": w.system}]


async def drive(base_url: str, model: str, w: Workload, cfg: ServeBenchConfig, say: Console,
                label: str) -> tuple[list[Sample], float]:
    """All sessions, `concurrency` at a time; returns the samples and the wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=600)
    gate = asyncio.Semaphore(cfg.concurrency)
    samples: list[Sample] = []

    async def run(s: Session) -> None:
        async with gate:
            messages = messages_of(w)
            for k, turn in enumerate(s.turns):
                messages.append({"role": "user", "content": turn})
                sample = await one_request(client, model, messages, w.tools, cfg.max_tokens, s.name)
                messages.append({"role": "assistant", "content": sample.text})
                samples.append(replace(sample, key=f"{s.name}/{k}"))
                if len(samples) % max(1, w.requests // 4) == 0:
                    say.log(f"{label}: {len(samples)}/{w.requests} requests", highlight=False)

    started = time.perf_counter()
    await asyncio.gather(*(run(s) for s in w.sessions))
    wall = time.perf_counter() - started
    await client.close()
    return samples, wall


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else 0.0


def summarize(samples: list[Sample], wall: float) -> dict:
    ttft = [s.ttft_s * 1000 for s in samples]
    tpot = [(s.total_s - s.ttft_s) * 1000 / (s.completion_tokens - 1) for s in samples if s.completion_tokens > 1]
    prompt = sum(s.prompt_tokens for s in samples)
    out = sum(s.completion_tokens for s in samples)
    return {"requests": len(samples), "ttft_ms_mean": round(sum(ttft) / max(1, len(ttft)), 2),
            "ttft_ms_p50": round(_pct(ttft, 0.5), 2), "ttft_ms_p99": round(_pct(ttft, 0.99), 2),
            "tpot_ms_p50": round(_pct(tpot, 0.5), 2), "output_tokens_per_s": round(out / wall, 2),
            "requests_per_s": round(len(samples) / wall, 3), "prompt_tokens": prompt,
            "cached_token_ratio": round(sum(s.cached_tokens for s in samples) / max(1, prompt), 4),
            "wall_s": round(wall, 2)}
