"""`kvmesh bench serve`: a multi-turn agent workload through the `openai` SDK, cache on vs off, one run.

For each mode the bench starts its own stack (`kvmesh up --detach` in a
temp state dir, free ports; cache off = `KVMESH_ENGINE__ENABLE_PREFIX_CACHING=false`
in the workers, and no L3), drives the workload (bench/serve_workload.py) at a fixed
concurrency (sessions in parallel, turns of a session in order, greedy,
streaming with usage) and stops the stack. Figures per mode: TTFT p50/p99,
TPOT p50, output tokens/s, requests/s, cached-token ratio; then
`ttft_ratio_cache_off_vs_on`. `service_overhead_ms_p50`: with the cache on,
a few extra sessions run one request at a time through the services and
through an in-process engine (same prompt ids, built with the ingress's own
prompt builder; same cache state), TTFT difference per request; the answers
must be identical (`overhead_identical`); `service_overhead_ms_p50_full_hit` sends each of
those requests a second time (all of it cached on both sides: the hops alone). Progress on
stderr, one JSON object.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.bench.serve_workload import Session, Workload, build_workload
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


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str


class SayLog:
    """`running_stack` reports through a rich Console's `log`: this sends it to a bench's progress function."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say

    def log(self, text: str) -> None:
        self._say(text)


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
        env = {**os.environ, "KVMESH_API_KEYS": f"{KEY}:bench", "KVMESH_INGRESS__PORT": str(port),
               "KVMESH_ENGINE__ENABLE_PREFIX_CACHING": "true" if cache else "false", "KVMESH_LOG_LEVEL": "warning",
               "KVMESH_INGRESS__RATE_LIMIT_PER_S": "1000", "KVMESH_INGRESS__RATE_LIMIT_BURST": "1000",
               # cache off: no L3 either, so the baseline pays no lookups for blocks it may not use
               "KVMESH_TIERS__L3_ENABLED": "true" if cfg.l3 and cache else "false", **(extra_env or {})}
        args = [kvmesh, "up", "--detach", "--model", str(model_dir), "--state-dir", tmp, "--nats-port", "0",
                "--nats-monitor-port", "0", "--s3-port", "0", "--prefill", str(cfg.prefill),
                "--decode", str(cfg.decode), "--timeout", "180"]
        say.log(f"starting a stack (prefix cache {'on' if cache else 'off'})")
        try:
            up = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)
            if up.returncode != 0:  # the state dir goes with the stack: keep the end of the log `up` names
                named = re.search(r"\(log: (\S+)\)", up.stderr)
                path = Path(named.group(1)) if named else None
                log = path.read_text(errors="replace")[-1500:] if path and path.exists() else ""
                raise RuntimeError(f"kvmesh up failed ({up.returncode}): {up.stderr[-2000:]}{log}")
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            subprocess.run([kvmesh, "down", "--state-dir", tmp], env=env, capture_output=True, timeout=120)


def stack_metric_families(state_dir: Path) -> Iterator:
    """Every metric family of every kvmesh service in a stack's state file (servers' consoles are skipped)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for ep in json.loads((state_dir / "stack.json").read_text())["endpoints"]:
        if not ep["url"].startswith("http://") or ep["check"] != "http":
            continue
        reply = httpx.get(f"{ep['url']}/metrics", timeout=10)
        if reply.status_code != 200:  # not a kvmesh service (a server's console)
            continue
        yield from text_string_to_metric_families(reply.text)


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


def _messages(w: Workload) -> list[dict]:
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
            messages = _messages(w)
            for turn in s.turns:
                messages.append({"role": "user", "content": turn})
                sample = await one_request(client, model, messages, w.tools, cfg.max_tokens, s.name)
                messages.append({"role": "assistant", "content": sample.text})
                samples.append(sample)
                if len(samples) % max(1, w.requests // 4) == 0:
                    say.log(f"{label}: {len(samples)}/{w.requests} requests", highlight=False)

    started = time.perf_counter()
    await asyncio.gather(*(run(s) for s in w.sessions))
    wall = time.perf_counter() - started
    await client.close()
    return samples, wall


@dataclass(slots=True)
class Overhead:
    """Service TTFT - engine TTFT (ms) per request; `repeat_ms`: the same request again (all of it cached)."""

    ms: list[float] = field(default_factory=list)
    repeat_ms: list[float] = field(default_factory=list)
    identical: int = 0
    total: int = 0


async def overhead(base_url: str, model: str, model_dir: Path, w: Workload, cfg: ServeBenchConfig) -> Overhead:
    """Sessions one request at a time through the services and the in-process engine (same ids, same cache)."""
    import openai
    from kvmesh.config import EngineSettings
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling import SamplingParams
    from kvmesh.ingress.core.prompt import PromptBuilder

    loaded = load_model(model_dir)
    engine = Engine(loaded, EngineSettings())
    prompts = PromptBuilder(loaded.tokenizer, 1024, loaded.config.eos_token_ids)
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0)

    def engine_ttft(ids: list[int]) -> tuple[float, list[int], str]:
        rid = f"r{time.perf_counter_ns()}"
        engine.add_request(rid, ids, params)
        ttft, out = None, None
        while engine.has_unfinished():
            for o in engine.step():
                ttft = o.ttft if ttft is None and o.ttft is not None else ttft
                out = o
        assert out is not None and ttft is not None
        return ttft, out.token_ids, out.text

    # the services have the shared system prompt and tools cached from the drive: so does the engine
    warm = _messages(w) + [{"role": "user", "content": "warm-up"}]
    engine_ttft(prompts.chat("bench", warm, w.tools))
    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=600)
    out = Overhead()
    for i, s in enumerate(w.sessions[: cfg.overhead_sessions]):
        messages = _messages(w)
        for k, turn in enumerate(s.turns):
            messages.append({"role": "user", "content": f"[overhead {i}] {turn}" if k == 0 else turn})
            for diffs in (out.ms, out.repeat_ms):
                got = await one_request(client, model, messages, w.tools, cfg.max_tokens, f"overhead-{i}")
                ttft, ids, text = await asyncio.to_thread(engine_ttft, prompts.chat("bench", messages, w.tools))
                diffs.append((got.ttft_s - ttft) * 1000)
            prompts.remember_answer("bench", text, ids)
            out.identical += got.text == text
            out.total += 1
            messages.append({"role": "assistant", "content": got.text})
    await client.close()
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else 0.0


def summarize(samples: list[Sample], wall: float) -> dict:
    ttft = [s.ttft_s * 1000 for s in samples]
    tpot = [(s.total_s - s.ttft_s) * 1000 / (s.completion_tokens - 1) for s in samples if s.completion_tokens > 1]
    prompt = sum(s.prompt_tokens for s in samples)
    out = sum(s.completion_tokens for s in samples)
    return {"requests": len(samples), "ttft_ms_p50": round(_pct(ttft, 0.5), 2), "ttft_ms_p99": round(_pct(ttft, 0.99), 2),
            "tpot_ms_p50": round(_pct(tpot, 0.5), 2), "output_tokens_per_s": round(out / wall, 2),
            "requests_per_s": round(len(samples) / wall, 3), "prompt_tokens": prompt,
            "cached_token_ratio": round(sum(s.cached_tokens for s in samples) / max(1, prompt), 4),
            "wall_s": round(wall, 2)}


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    say = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-model-") as tmp:
        model_dir = cfg.model_dir
        if model_dir is None:
            from kvmesh.engine.presets import write_preset

            model_dir = write_preset(Path(tmp) / cfg.preset, cfg.preset, "llama", seed=0)
        model = model_dir.name
        w = build_workload(cfg.sessions, cfg.turns, REPO_ROOT)
        say.log(f"workload: {len(w.sessions)} sessions x {cfg.turns} turns ({w.source}), "
                f"concurrency {cfg.concurrency}, model {model}")
        result: dict = {"workload": w.source, "sessions": len(w.sessions), "turns": cfg.turns,
                        "concurrency": cfg.concurrency, "max_tokens": cfg.max_tokens, "model": model, "l3": cfg.l3}
        for cache in (True, False):
            label = "cache_on" if cache else "cache_off"
            with running_stack(model_dir, cfg, cache, say) as url:
                samples, wall = asyncio.run(drive(url, model, w, cfg, say, label))
                result[label] = summarize(samples, wall)
                if cache and cfg.overhead_sessions:
                    say.log("service overhead: services vs in-process engine, one request at a time")
                    oh = asyncio.run(overhead(url, model, model_dir, w, cfg))
                    result["service_overhead_ms_p50"] = round(_pct(oh.ms, 0.5), 2)
                    result["service_overhead_ms_p50_full_hit"] = round(_pct(oh.repeat_ms, 0.5), 2)
                    result["overhead_requests"] = oh.total
                    result["overhead_identical"] = f"{oh.identical}/{oh.total}"
        on, off = result["cache_on"]["ttft_ms_p50"], result["cache_off"]["ttft_ms_p50"]
        result["ttft_ratio_cache_off_vs_on"] = round(off / on, 3) if on else None
        result["throughput_ratio_on_vs_off"] = round(result["cache_on"]["output_tokens_per_s"]
                                                     / max(1e-9, result["cache_off"]["output_tokens_per_s"]), 3)
        return result
