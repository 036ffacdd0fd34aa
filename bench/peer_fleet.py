"""`kvmesh bench peer --fleet`: two vLLM servers behind round-robin against two vLLM workers under kvmesh.

What a vLLM user scales out to is N servers, each with its own prefix cache, behind a load balancer
that spreads calls round-robin. kvmesh's answer is the same vLLM, as the engine of its prefill workers
(`kvmesh up --engine vllm --prefill 2`): the ingress routes each call to the worker whose blocks the
cache index says hold its prefix, and the connector keeps what vLLM's pool lets go of in the worker's L2
and in S3. Same checkpoint, same KV pool per instance (`kv_cache_gib`), the same cores (every vLLM binds all of them, none reserved), the same SWE-agent
sessions (bench/peer_workloads.py, with their tool time), one system after the other on this box:

1. `agents`: every call of each session but its last (more context than one instance's pool holds);
2. every instance restarts (new processes: empty pools; kvmesh keeps only what reached S3);
3. `returning`: each session's last call, one at a time: restore against recompute.

Out: one JSON object: per system and phase the TTFT summary and cached/prompt, and kvmesh/vLLM ratios
(below 1: kvmesh faster).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

from kvmesh.bench.connector import split_sessions
from kvmesh.bench.peer import (
    VLLM_BLOCK,
    PeerConfig,
    _ratio,
    peer_version,
    pool_blocks,
    stack_compute,
    vllm_compute,
    vllm_server,
)
from kvmesh.bench.peer_drive import Timing, run_sessions, send, summary
from kvmesh.net import free_port

KEY = "sk-bench-fleet"
INSTANCES = 2


class RoundRobin:
    """OpenAI clients behind one: each call goes to the next one, as a plain load balancer sends it."""

    def __init__(self, clients: list) -> None:
        self._clients = clients
        self._turn = itertools.count()
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **kw):
        return await self._clients[next(self._turn) % len(self._clients)].chat.completions.create(**kw)

    async def close(self) -> None:
        for c in self._clients:
            await c.close()


async def _drive(urls: list[str], api_key: str, model: str, sessions, calls, say) -> list[Timing]:
    from openai import AsyncOpenAI

    client = RoundRobin([AsyncOpenAI(base_url=u, api_key=api_key, max_retries=0, timeout=900) for u in urls])
    try:
        if sessions is not None:
            return await run_sessions(client, model, sessions, say)
        return [await send(client, model, "returning", c) for c in calls]
    finally:
        await client.close()


@contextmanager
def _vllm_pair(cfg: PeerConfig, say: Callable[[str], None], round_: int,
               compute: dict[str, dict]) -> Iterator[list[str]]:
    ports = [free_port() for _ in range(INSTANCES)]
    with ExitStack() as stack:
        for i, port in enumerate(ports):
            log, pid = stack.enter_context(vllm_server(cfg, port, say, ("--block-size", str(VLLM_BLOCK)), None,
                                                       f"fleet-vllm-{i}-{round_}.log"))
            compute[f"vllm-{i}"] = vllm_compute(log, pid)
        yield [f"http://127.0.0.1:{p}/v1" for p in ports]


@contextmanager
def _kvmesh_fleet(cfg: PeerConfig, state_dir: Path, port: int, say: Callable[[str], None],
                  compute: dict[str, dict]) -> Iterator[list[str]]:
    kvmesh = str(Path(cfg.peer_python).parent / "kvmesh")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")},
           "KVMESH_STATE_DIR": str(state_dir), "KVMESH_INGRESS__PORT": str(port), "KVMESH_API_KEYS": f"{KEY}:bench",
           "KVMESH_ENGINE__NUM_BLOCKS": str(pool_blocks(cfg, VLLM_BLOCK)),
           "KVMESH_INGRESS__FIRST_TOKEN_TIMEOUT_S": "900", "KVMESH_TIERS__L3_TAIL_DELAY_S": "0"}
    up = subprocess.run([kvmesh, "up", "--detach", "--engine", "vllm", "--model", str(cfg.model_dir),
                         "--prefill", str(INSTANCES), "--nats-port", "0", "--nats-monitor-port", "0", "--s3-port",
                         "0", "--timeout", "900"], env=env, capture_output=True, text=True, timeout=1000)
    try:
        if up.returncode != 0:
            raise RuntimeError(f"kvmesh up --engine vllm failed ({up.returncode}): {up.stderr[-3000:]}")
        say("kvmesh fleet ready")
        compute.update(stack_compute(state_dir))
        yield [f"http://127.0.0.1:{port}/v1"]
    finally:
        subprocess.run([kvmesh, "down"], env=env, capture_output=True, timeout=300)


def run_fleet_bench(cfg: PeerConfig, say: Callable[[str], None]) -> dict:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    before, last, notes = split_sessions(cfg)
    say(f"{notes['sessions']} sessions: {notes['calls_before_restart']} calls, a restart, "
        f"{notes['returning_calls']} returning calls ({notes['context_tokens_held_by_sessions']} tokens of context)")
    model = cfg.model_dir.name
    state_dir = cfg.out_dir / "kvmesh-fleet-state"
    shutil.rmtree(state_dir, ignore_errors=True)  # nothing from an earlier run in kvmesh's S3
    results: dict[str, dict] = {}
    compute: dict[str, dict] = {"vllm_round_robin": {}, "kvmesh_vllm": {}}
    for system in ("vllm_round_robin", "kvmesh_vllm"):
        phases: dict[str, dict] = {}
        port = free_port()
        for round_, phase in enumerate(("agents", "returning")):
            say(f"{system}: starting for {phase}")
            if system == "vllm_round_robin":
                servers, api_key = _vllm_pair(cfg, say, round_, compute[system]), "none"
            else:
                servers, api_key = _kvmesh_fleet(cfg, state_dir, port, say, compute[system]), KEY
            with servers as urls:
                start = time.monotonic()
                got = asyncio.run(_drive(urls, api_key, model, before if phase == "agents" else None, last, say))
                phases[phase] = summary(got, time.monotonic() - start)
            say(f"{system}: {phase} TTFT mean {phases[phase]['ttft_s']['mean']} s, "
                f"cached/prompt {phases[phase].get('cached_over_prompt')}")
        results[system] = phases
    ours, theirs = results["kvmesh_vllm"], results["vllm_round_robin"]
    ratios = {f"{phase}_ttft_{k}": _ratio(ours[phase]["ttft_s"][k], theirs[phase]["ttft_s"][k])
              for phase in ("agents", "returning") for k in ("mean", "p50", "p99")}
    out = {"bench": "peer-fleet", "vllm_version": peer_version(cfg.peer_python), "workload": notes,
           "config": {"instances": INSTANCES, "block_size": VLLM_BLOCK, "kv_cache_gib_each": cfg.kv_cache_gib,
                      "kvmesh_pool_blocks_each": pool_blocks(cfg, VLLM_BLOCK), "cpus": os.cpu_count(),
                      "sessions": cfg.sessions, "calls": cfg.calls,
                      "agent_max_tokens": cfg.agent_max_tokens, "seed": cfg.seed},
           "compute": compute, "results": results, "kvmesh_over_vllm": ratios}
    (cfg.out_dir / "peer-fleet.json").write_text(json.dumps(out, indent=2))
    return out
