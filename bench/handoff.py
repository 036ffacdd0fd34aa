"""`kvmesh bench handoff`: the prefill -> decode handoff at real KV geometry, through `kvmesh up`.

One SWE-agent session (bench/peer_workloads.py: recorded history, so every call extends the one before)
goes turn by turn through a local stack of one prefill and one decode worker serving a checkpoint with
Llama-3-8B (or -70B) KV geometry (shared/engine/presets.py: the real 32 x 8 x 128 bf16 KV, hidden size
cut to CPU size). The ingress is told to hand every request off (`decode_placement=split`), so each turn's
first token comes from prefill-0 and the rest from decode-0, which has to get the prompt's KV first.

Per turn, from the client's token arrival times (OpenAI SDK, streaming, `ignore_eos`):
- `handoff_s`: the gap between tokens 1 and 2 beyond a steady token (the median of the later gaps);
- `moved_bytes`: the KV decode-0 did not hold yet (the prompt's full blocks beyond the previous turn's
  prompt + output, which decode-0 keeps in its pool), and `handoff_gbps` = moved_bytes / handoff_s;
- `memcpy_s`: the same bytes copied block by block on this box (one thread, pre-faulted buffers), and
  `handoff_over_memcpy`;
- `h200_recompute_s`: recomputing the whole prompt on an H200 (shared/sim/recompute_model.py, printed);
- the workers' own spans, joined on the request id: prefill-0's `store` (the blocks not yet in L2 when
  the first token came, stored before the DecodeJob goes out), decode-0's `resolve` (fetching what its
  pool lacks after the DecodeJob) and where decode-0's blocks came from (`L1`: already in its pool:
  pulled while the prompt was prefilled, shared/serving/prefill_stream.py, or kept from the turn before).

What is left of `handoff_s` beyond those spans is the DecodeJob's JetStream hop and decode-0's first step,
which computes the prompt's partial last block and the first token (a block-sized handoff leaves them to
decode) before it samples token 2.

The session runs twice, each on a fresh stack: with L3 (S3 uploads of the same blocks running beside the
handoff) and without, so `l3_on_over_off_mean_handoff` (the turns' mean handoff, on over off) shows what
the uploads cost the handoff.

    kvmesh bench handoff --geometry 8b --json
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
from kvmesh.bench import peer_workloads as wl
from kvmesh.bench.peer_breakdown import handoff_and_tpot, logged, prefill_spans
from kvmesh.bench.peer_drive import Timing, send
from kvmesh.sim.recompute_model import GEOMETRIES, describe, recompute_s

REPO = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 16  # the stack's engine.block_size (the default)
MIN_TIMED_S = 1e-3  # a handoff shorter than this beyond the steady token is within the noise: no rate


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    geometry: str = "8b"
    turns: int = 4
    min_first_tokens: int = 2000  # the first SWE-agent session whose first call is at least this long
    max_tokens: int = 16
    mfu: float = 0.5
    l3_modes: tuple[bool, ...] = (True, False)
    out_dir: Path | None = None  # where each stack's state dir (logs) and handoff.json go; None: a temp dir


def session_calls(model_dir: Path, cfg: HandoffConfig) -> list[wl.Call]:
    """The calls of the recorded session whose first call is the shortest with at least `min_first_tokens` tokens."""
    from kvmesh.engine.checkpoint import read_json
    from kvmesh.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    context = int(read_json(model_dir / "config.json")["max_position_embeddings"])

    def tokens(messages: list[dict]) -> int:
        return len(tok.encode(tok.apply_chat_template(messages)))

    sessions, _ = wl.agent_sessions(REPO, 16, cfg.turns, cfg.max_tokens, context, tokens, seed=0)
    fit = sorted((tokens(list(s.calls[0].messages)), i) for i, s in enumerate(sessions) if len(s.calls) >= cfg.turns)
    fit = [i for n, i in fit if n >= cfg.min_first_tokens]
    if not fit:
        raise RuntimeError(f"no recorded session has {cfg.turns} calls and a first call of {cfg.min_first_tokens}+ tokens")
    return [wl.Call(c.messages, cfg.max_tokens) for c in sessions[fit[0]].calls[:cfg.turns]]


def memcpy_s(nbytes: int, block_bytes: int, repeats: int = 3) -> float:
    """Copy `nbytes` block by block between pre-faulted buffers, one thread; the best of `repeats`."""
    if nbytes <= 0:
        return 0.0
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for at in range(0, nbytes, block_bytes):
            dst[at:at + block_bytes] = src[at:at + block_bytes]
        best = min(best, time.perf_counter() - t0)
    return best


def decode_spans(log_dir: Path) -> dict[str, dict]:
    """request hex -> decode-0's `decode blocks resolved` line: `ms` (fetching the handed-off blocks after the
    DecodeJob) and `sources` (blocks per tier; L1: in its pool already, e.g. pulled while the prompt was prefilled)."""
    out: dict[str, dict] = {}
    for rec in logged(log_dir, "decode-*.log", ("decode blocks resolved",)):
        out.setdefault(rec["request_id"].removeprefix("req_"), rec)
    return out


def _request_hex(t: Timing) -> str:
    return t.request_id.removeprefix("chatcmpl-")


def turn_row(t: Timing, held_blocks: int, block_bytes: int, geo_name: str, mfu: float) -> dict:
    """One turn's figures; `held_blocks`: full blocks decode-0 kept from the turn before."""
    timed = handoff_and_tpot(t) if t.ok else None
    if timed is None:
        return {"error": t.error or f"{len(t.token_times)} tokens streamed: too few to time the handoff"}
    handoff, tpot = timed  # handoff at or below 0 (noise): token 2 came no later than a steady token
    moved = max(0, t.prompt_tokens // BLOCK_TOKENS - held_blocks) * block_bytes
    copy = memcpy_s(moved, block_bytes)
    timed = handoff > MIN_TIMED_S
    return {"prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens, "moved_bytes": moved,
            "ttft_s": round(t.ttft_s, 4), "tpot_s": round(tpot, 4), "handoff_s": round(handoff, 4),
            "handoff_gbps": round(moved / handoff / 1e9, 3) if timed else None, "memcpy_s": round(copy, 4),
            "handoff_over_memcpy": round(handoff / copy, 2) if timed and copy else None,
            "h200_recompute_s": round(recompute_s(GEOMETRIES[geo_name], t.prompt_tokens, mfu), 4)}


async def run_session(url: str, model: str, calls: list[wl.Call], say: Callable[[str], None]) -> list[Timing]:
    from kvmesh.bench.serve import KEY
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=600)
    out = []
    for i, call in enumerate(calls):
        t = await send(client, model, "handoff", call, extra_body={"ignore_eos": True})
        say(f"turn {i + 1}: {t.prompt_tokens} prompt tokens, TTFT {t.ttft_s if t.ok else t.error}")
        out.append(t)
    await client.close()
    return out


def run_mode(model_dir: Path, calls: list[wl.Call], cfg: HandoffConfig, state: Path, l3: bool, block_bytes: int,
             say: Callable[[str], None]) -> dict:
    from kvmesh.bench.serve import SayLog, ServeBenchConfig, running_stack

    env = {"KVMESH_LOG_LEVEL": "info", "KVMESH_INGRESS__DECODE_PLACEMENT": "split",
           "KVMESH_INGRESS__FIRST_TOKEN_TIMEOUT_S": "600"}
    with running_stack(model_dir, ServeBenchConfig(model_dir=model_dir, l3=l3), True, SayLog(say), env, state) as url:
        timings = asyncio.run(run_session(url, model_dir.name, calls, say))
    stores = prefill_spans(state / "logs")
    resolves = decode_spans(state / "logs")
    rows, held = [], 0
    for t in timings:
        row = turn_row(t, held, block_bytes, cfg.geometry, cfg.mfu)
        rid = _request_hex(t)
        if rid in stores:
            row["prefill_store_s"] = round(float(stores[rid][1].get("store", 0.0)) / 1000, 4)
        if rid in resolves:
            row["decode_resolve_s"] = round(float(resolves[rid].get("ms", 0.0)) / 1000, 4)
            row["decode_blocks_by_tier"] = resolves[rid].get("sources", {})
        rows.append(row)
        held = (t.prompt_tokens + t.completion_tokens) // BLOCK_TOKENS
    return {"turns": rows}


def run_handoff_bench(cfg: HandoffConfig, say: Callable[[str], None]) -> dict:
    from kvmesh.engine.presets import write_preset

    geo = GEOMETRIES[cfg.geometry]
    block_bytes = geo.kv_bytes_per_token * BLOCK_TOKENS
    with tempfile.TemporaryDirectory(prefix="kvmesh-handoff-") as tmp:
        root = cfg.out_dir or Path(tmp)
        model_dir = write_preset(Path(tmp) / geo.preset, geo.preset)
        calls = session_calls(model_dir, cfg)
        modes = {}
        for l3 in cfg.l3_modes:
            name = "l3_on" if l3 else "l3_off"
            say(f"{name}: starting a stack on {geo.preset}")
            modes[name] = run_mode(model_dir, calls, cfg, root / name, l3, block_bytes, say)
    first = modes[next(iter(modes))]["turns"][0]
    out = {"bench": "handoff", "geometry": cfg.geometry, "preset": geo.preset, "block_bytes": block_bytes,
           "path": "kvmesh up: ingress -> prefill-0 (token 1) -> DecodeJob -> decode-0 (tokens 2..); "
                   "decode_placement=split, one host (decode reads prefill-0's L2 through shared memory)",
           "at": datetime.now().isoformat(timespec="seconds"), "modes": modes,
           "h200_recompute_model": describe(geo, first.get("prompt_tokens", 0) or 1, cfg.mfu)}
    for mode in modes.values():
        gaps = [r["handoff_s"] for r in mode["turns"] if "handoff_s" in r]
        mode["handoff_s_first_turn"] = gaps[0] if gaps else None
        mode["handoff_s_mean"] = round(statistics.fmean(gaps), 4) if gaps else None
    if {"l3_on", "l3_off"} <= modes.keys():
        on, off = modes["l3_on"]["handoff_s_mean"], modes["l3_off"]["handoff_s_mean"]
        out["l3_on_over_off_mean_handoff"] = round(on / off, 2) if on and off and off > MIN_TIMED_S else None
    if cfg.out_dir is not None:
        (cfg.out_dir / "handoff.json").write_text(json.dumps(out, indent=2))
    return out
