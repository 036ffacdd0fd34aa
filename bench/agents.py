"""`kvmesh bench agents`: concurrent agent sessions through the local stack, the shipped default vs LRU, one run.

The workload (bench/agent_workload.py) replays SWE-agent trajectories as
OpenAI tool-calling loops: every session's calls extend each other, and
between two calls the agent runs a tool for seconds. The stack's L1 is
small (`l1_blocks` per worker) so that the sessions' contexts do not all
fit and eviction decides who hits; L2 is as small (`l2_blocks`' worth of
bytes) and L3 is off by default (`--l3` turns it on), so a session evicted
from L1 cannot simply come back from host memory or S3: at the agent
preset's 8 KiB blocks a restore costs next to nothing on any tier, while a
recompute queues for the CPU.

Three modes, each on a fresh stack with the same model, settings and prompts:

- `default`: what `kvmesh up` ships: the `default` policy (shared/cache_policy/default.py)
  ranking each worker's own evictions and the eviction service's advice, and
  session retention on (pins while a tool runs, prefetch before a predicted
  return, ended sessions demoted first);
- `retention_off`: the same policy, session retention off
  (`KVMESH_EVICTION__SESSIONS__ENABLED=false`);
- `lru`: LRU in the workers and in the advice, retention off: what an engine's
  own prefix cache does.

Per mode: TTFT mean/p50/p99, the p99 of *returning* calls (k >= 1: the call
re-sends a prefix the stack computed for the session's previous call; first
calls are cold under every policy), cached-token ratio, and every request's
output tokens; `same_outputs` says whether every mode answered every request
identically (cache transparency: the cache may change speed, never tokens).
`ratios` divides each other mode's TTFT figures by the default's: above 1,
the default wins.
A call that ends in a clean error (an overloaded machine: a worker silent
past its timeout) is counted in `failed_calls` and left out of the figures
and the comparison; the session goes on with its next call.
`misses` splits each mode's uncached prompt tokens into those the stack had
computed for the session's previous call and lost between the two calls
(`evicted`: while the tool ran or the call was queued) and those no earlier
call sent (`cold`).
Progress on stderr; one JSON object.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bench.agent_workload import (
    AgentSession,
    AgentWorkload,
    build_agent_workload,
)
from kvmesh.bench.serve import (
    KEY,
    REPO_ROOT,
    Sample,
    ServeBenchConfig,
    _pct,
    running_stack,
    stack_metric_families,
    stream_chat,
)
from rich.console import Console

AGENT_PRESET = "agent"  # random weights with 32k positions: every session fits
BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class AgentsBenchConfig:
    sessions: int = 12
    max_steps: int = 10  # calls per session after the first
    max_tokens: int = 8
    arrival_rate: float = 1.0  # sessions starting per second
    l1_blocks: int = 3072  # per worker: about a quarter of the sessions' peak contexts together
    l2_blocks: int = 1024
    l3: bool = False  # without S3 an evicted context is recomputed: what retention saves shows in TTFT
    seed: int = 0
    tool_median_s: float = 1.5  # the tool runs between calls: log-normal, capped at 4x the median


@dataclass(frozen=True, slots=True)
class Call:
    session: str
    k: int
    sample: Sample


async def drive(base_url: str, model: str, w: AgentWorkload, cfg: AgentsBenchConfig, say: Console,
                label: str) -> tuple[list[Call], list[tuple[str, int]]]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=900)
    calls: list[Call] = []
    failed: list[tuple[str, int]] = []
    t0 = time.perf_counter()

    async def run(s: AgentSession) -> None:
        await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t0)))
        for k in range(len(s.steps) + 1):
            try:
                sample = await stream_chat(client, model, s.messages(k), w.tools, cfg.max_tokens,
                                           extra_headers={"x-session-id": s.name})
            except openai.APIError as exc:  # a clean error (an overloaded box): counted, the agent goes on
                say.log(f"{label}: {s.name} call {k} failed: {exc}", highlight=False)
                failed.append((s.name, k))
            else:
                calls.append(Call(s.name, k, sample))
            if k < len(s.steps):
                await asyncio.sleep(s.steps[k].tool_s)  # the agent runs the tool it just called
        say.log(f"{label}: {s.name} done ({len(calls)}/{w.requests} calls)", highlight=False)

    await asyncio.gather(*(run(s) for s in w.sessions))
    await client.close()
    return calls, failed


def misses(calls: list[Call]) -> dict:
    """Where the uncached prompt tokens came from, per call of a session (call k re-sends call k-1's prompt):

    - `evicted`: tokens of the previous call's prompt (its full blocks) that were not cached: the stack had
      computed them and lost them between the two calls, while the agent ran its tool or the call waited
      in a queue;
    - `cold`: tokens no earlier call of the session sent (its first call, the new tool result): a miss
      under any policy (except what another session shares, the system prompt).
    `calls_evicted`: calls that lost at least one block."""
    by_session: dict[str, list[Call]] = {}
    for c in calls:
        by_session.setdefault(c.session, []).append(c)
    evicted = cold = calls_evicted = 0
    for seq in by_session.values():
        seq.sort(key=lambda c: c.k)
        before = 0
        for c in seq:
            s = c.sample
            reusable = min(before, s.prompt_tokens) // BLOCK_TOKENS * BLOCK_TOKENS
            lost = max(0, reusable - s.cached_tokens)
            evicted, calls_evicted = evicted + lost, calls_evicted + (lost >= BLOCK_TOKENS)
            cold += s.prompt_tokens - max(s.cached_tokens, reusable)
            before = s.prompt_tokens
    total = evicted + cold
    return {"miss_tokens": total, "miss_evicted_tokens": evicted, "miss_cold_tokens": cold,
            "miss_evicted_share": round(evicted / max(1, total), 4), "calls_evicted": calls_evicted}


def summarize(calls: list[Call]) -> dict:
    ttft = [c.sample.ttft_s * 1000 for c in calls]
    prompt = sum(c.sample.prompt_tokens for c in calls)
    return {"requests": len(calls), "ttft_ms_p50": round(_pct(ttft, 0.5), 1), "ttft_ms_p99": round(_pct(ttft, 0.99), 1),
            "ttft_ms_mean": round(sum(ttft) / max(1, len(ttft)), 1),
            # the calls retention can help (k >= 1 re-sends the previous call) and the first calls it cannot
            "ttft_ms_p99_returning": round(_pct([c.sample.ttft_s * 1000 for c in calls if c.k > 0], 0.99), 1),
            "ttft_ms_p99_first_calls": round(_pct([c.sample.ttft_s * 1000 for c in calls if c.k == 0], 0.99), 1),
            "prompt_tokens": prompt,
            "output_tokens": sum(c.sample.completion_tokens for c in calls),
            "cached_token_ratio": round(sum(c.sample.cached_tokens for c in calls) / max(1, prompt), 4),
            "misses": misses(calls)}


# What the session planner and the ingress did, and what the workers' engines took back from pins and
# leases under pressure, from their /metrics (counters summed over labels).
WATCHED = ("kvmesh_session_", "kvmesh_ingress_session_events", "kvmesh_l1_pins_yielded", "kvmesh_l1_leases_broken",
           "kvmesh_engine_preemptions")


def session_counters(state_dir: Path) -> dict[str, float]:
    """The stack's session counters, read from every service endpoint in its state file."""
    out: dict[str, float] = {}
    for family in stack_metric_families(state_dir):
        if family.name.startswith(WATCHED) and family.type == "counter":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = sample.name + "".join(f"_{v}" for v in sample.labels.values())
                    out[key] = out.get(key, 0.0) + sample.value
    return out


RATIO_KEYS = ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "ttft_ms_p99_returning")  # other modes / default


def run_agents_bench(cfg: AgentsBenchConfig) -> dict:
    from kvmesh.engine.presets import write_preset

    say = Console(stderr=True)
    w = build_agent_workload(REPO_ROOT, cfg.sessions, seed=cfg.seed, arrival_rate=cfg.arrival_rate,
                             max_steps=cfg.max_steps, tool_median_s=cfg.tool_median_s,
                             tool_cap_s=4 * cfg.tool_median_s)
    result: dict = {"sessions": len(w.sessions), "requests": w.requests, "l1_blocks": cfg.l1_blocks,
                    "l2_blocks": cfg.l2_blocks, "l3": cfg.l3, "max_tokens": cfg.max_tokens,
                    "arrival_rate": cfg.arrival_rate, "tool_median_s": cfg.tool_median_s}
    outputs: dict[str, dict[tuple[str, int], str]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-agents-") as tmp:
        model_dir = write_preset(Path(tmp) / AGENT_PRESET, AGENT_PRESET, "llama", seed=0)
        kv_block_bytes = 512 * BLOCK_TOKENS  # the agent preset: 2 layers x 2 KV heads x 16 dims x K,V x fp32
        base = {"KVMESH_ENGINE__NUM_BLOCKS": str(cfg.l1_blocks), "KVMESH_ENGINE__BLOCK_SIZE": str(BLOCK_TOKENS),
                "KVMESH_TIERS__L2_CAPACITY_BYTES": str(cfg.l2_blocks * kv_block_bytes)}
        modes = {
            "default": {},
            "retention_off": {"KVMESH_EVICTION__SESSIONS__ENABLED": "false"},
            "lru": {"KVMESH_EVICTION__SESSIONS__ENABLED": "false", "KVMESH_EVICTION__POLICY": "lru",
                    "KVMESH_ENGINE__EVICTION_POLICY": "lru"},
        }
        stack_cfg = ServeBenchConfig(model_dir=model_dir, l3=cfg.l3)
        for mode, env in modes.items():
            state_dir = Path(tmp) / f"stack-{mode}"
            state_dir.mkdir()
            with running_stack(model_dir, stack_cfg, True, say, {**base, **env}, state_dir) as url:
                say.log(f"{mode}: {len(w.sessions)} sessions, {w.requests} calls")
                calls, failed = asyncio.run(drive(url, model_dir.name, w, cfg, say, mode))
                counters = session_counters(state_dir)
            result[mode] = summarize(calls) | {"failed_calls": len(failed), "session_counters": counters}
            outputs[mode] = {(c.session, c.k): c.sample.text for c in calls}
    base = outputs["default"]
    result["same_outputs"] = all(base[key] == out[key] for out in outputs.values()
                                 for key in base.keys() & out.keys())  # failed calls (counted) are not compared
    result["ratios"] = {f"{mode}_vs_default": {k: round(result[mode][k] / max(1e-9, result["default"][k]), 3)
                                               for k in RATIO_KEYS}
                        for mode in modes if mode != "default"}
    return result

