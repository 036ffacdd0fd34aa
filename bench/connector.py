"""`kvmesh bench connector`: vLLM alone against vLLM with kvmesh as its KV layer (one instance, same box).

What a vLLM user has is its pool and its prefix cache; what kvmesh adds through its connector
(kvmesh.connectors.vllm) is the worker's L2 and S3 behind them. Both runs are vLLM's OpenAI server on the
same checkpoint, with the same small KV pool (`kv_cache_gib`, so the agent sessions hold more context than
the pool does), one after the other:

1. `agents`: SWE-agent sessions replayed with their recorded history and tool time (bench/peer_workloads.py),
   every call but each session's last.
2. The server restarts: a new process, an empty pool (and, with kvmesh, a new L2; only L3 outlives it).
3. `returning`: each session's last call, one after another: the turn an agent sends after its worker
   restarted. vLLM alone recomputes it; with kvmesh it is restored from L3.

Out: one JSON object, per system and phase the TTFT summary and cached share, and the kvmesh/vLLM ratios
(below 1: kvmesh faster). `returning_ttft_mean` is the restore-vs-recompute ratio of issue 30's target.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kvmesh.bench import peer_workloads as wl
from kvmesh.bench.peer import REPO, PeerConfig, _ratio, vllm_compute, vllm_server
from kvmesh.bench.peer_drive import Timing, run_sessions, send, summary
from kvmesh.net import free_port

CONNECTOR = {"kv_connector": "KVMeshConnector", "kv_connector_module_path": "kvmesh.connectors.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
SETTLE_S = 120.0  # at most this long for the L3 uploads to land before the restart


def split_sessions(cfg: PeerConfig) -> tuple[tuple[wl.Session, ...], tuple[wl.Call, ...], dict]:
    """The sessions without their last call, and those last calls (sessions of one call are left out)."""
    from kvmesh.engine.checkpoint import read_json
    from kvmesh.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(cfg.model_dir)
    context = int(read_json(cfg.model_dir / "config.json")["max_position_embeddings"])

    def tokens(messages: list[dict]) -> int:
        return len(tok.encode(tok.apply_chat_template(messages)))

    sessions, cut = wl.agent_sessions(REPO, cfg.sessions, cfg.calls, cfg.agent_max_tokens, context, tokens, cfg.seed)
    kept = [s for s in sessions if len(s.calls) > 1]
    before = tuple(replace(s, calls=s.calls[:-1]) for s in kept)
    last = tuple(s.calls[-1] for s in kept)
    longest = [tokens(list(c.messages)) for c in last]
    notes = {"sessions": len(kept), "calls_before_restart": sum(len(s.calls) for s in before),
             "returning_calls": len(last), "returning_prompt_tokens": longest,
             "context_tokens_held_by_sessions": sum(longest), "calls_cut_to_fit_context": cut}
    return before, last, notes


async def _drive(port: int, model: str, sessions: tuple[wl.Session, ...] | None, calls: tuple[wl.Call, ...],
                 say: Callable[[str], None]) -> list[Timing]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    try:
        if sessions is not None:
            return await run_sessions(client, model, sessions, say)
        return [await send(client, model, "returning", c) for c in calls]  # one at a time: restore vs recompute
    finally:
        await client.close()


def _settle(s3, bucket: str, say: Callable[[str], None]) -> int:
    """Wait until the bucket's object count stops changing (the uploads behind the last turns landed)."""
    client = s3.client()
    deadline, last, stable_since = time.monotonic() + SETTLE_S, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = sum(1 for _ in client.list_objects(bucket, recursive=True)) if client.bucket_exists(bucket) else 0
        if n != last:
            last, stable_since = n, time.monotonic()
        elif time.monotonic() - stable_since >= 5.0:
            break
        time.sleep(1.0)
    say(f"L3 holds {last} chunk objects")
    return last


def run_connector_bench(cfg: PeerConfig, l2_bytes: int, say: Callable[[str], None]) -> dict:
    from kvmesh.stack.servers import S3Server

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    before, last, notes = split_sessions(cfg)
    say(f"{notes['sessions']} sessions: {notes['calls_before_restart']} calls, a restart, "
        f"{notes['returning_calls']} returning calls ({notes['context_tokens_held_by_sessions']} tokens of context)")
    results: dict[str, dict] = {}
    compute: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        s3 = S3Server(data_dir=Path(tmp) / "s3")
        s3.start()
        try:
            for system in ("vllm", "vllm+kvmesh"):
                extra_args: tuple[str, ...] = ()
                env: dict[str, str] = {}
                if system == "vllm+kvmesh":
                    extra_args = ("--kv-transfer-config", json.dumps(CONNECTOR))
                    env = {"KVMESH_S3_ENDPOINT": s3.endpoint, "KVMESH_S3_ACCESS_KEY": s3.access_key,
                           "KVMESH_S3_SECRET_KEY": s3.secret_key, "KVMESH_S3__BUCKET": "bench-connector",
                           "KVMESH_TIERS__L2_CAPACITY_BYTES": str(l2_bytes), "KVMESH_TIERS__L3_TAIL_DELAY_S": "0",
                           "KVMESH_STATE_DIR": str(Path(tmp) / "state")}
                phases: dict[str, dict] = {}
                port = free_port()
                say(f"{system}: starting")
                with vllm_server(cfg, port, say, extra_args, env, f"{system}-1.log") as (log, pid):
                    compute[system] = vllm_compute(log, pid)
                    start = time.monotonic()
                    got = asyncio.run(_drive(port, cfg.model_dir.name, before, (), say))
                    phases["agents"] = summary(got, time.monotonic() - start)
                say(f"{system}: agents TTFT mean {phases['agents']['ttft_s']['mean']} s; restarting")
                if system == "vllm+kvmesh":
                    phases["l3_objects_at_restart"] = _settle(s3, "bench-connector", say)
                with vllm_server(cfg, port, say, extra_args, env, f"{system}-2.log"):
                    start = time.monotonic()
                    got = asyncio.run(_drive(port, cfg.model_dir.name, None, last, say))
                    phases["returning"] = summary(got, time.monotonic() - start)
                say(f"{system}: returning TTFT mean {phases['returning']['ttft_s']['mean']} s")
                results[system] = phases
        finally:
            s3.stop()
    ours, theirs = results["vllm+kvmesh"], results["vllm"]
    ratios = {f"{phase}_ttft_{k}": _ratio(ours[phase]["ttft_s"][k], theirs[phase]["ttft_s"][k])
              for phase in ("agents", "returning") for k in ("mean", "p50", "p99")}
    return {"bench": "connector", "workload": notes,
            "compute": compute,
            "config": {"kv_cache_gib": cfg.kv_cache_gib, "l2_bytes": l2_bytes,
                       "sessions": cfg.sessions, "calls": cfg.calls, "agent_max_tokens": cfg.agent_max_tokens,
                       "seed": cfg.seed},
            "results": results, "kvmesh_over_vllm": ratios}
