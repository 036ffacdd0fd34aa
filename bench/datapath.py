"""The KV data path at real model geometry: every tier's restore against memcpy and modeled H200 recompute.

A session's chain of `--context` tokens at Llama-3-8B or -70B KV geometry
(bench/kv_chain.py: the engine's own hashes, synthetic K/V) is restored
into a real engine's bf16 pool from each tier in turn, the same bytes each
time, and compared with one memcpy of those bytes (`*_vs_memcpy`, a rate
ratio: 1.0 = as fast as the copy) and with recomputing the same tokens on
an H200 (`*_vs_h200_recompute`, a time ratio: below 1 the restore wins;
shared/sim/recompute_model.py, printed with the result):

- l2: this worker's host tier (verify + import);
- peer: another process's L2 over the network path (NATS; no shared memory,
  as between containers);
- l3: chunks in S3 (the local S3 server), pipelined GETs;
- handoff: a decode worker taking the whole context from the prefill
  worker that just computed it, on one host (the owner's shared memory, as
  in the local stack): `handoff_vs_memcpy` = handoff time / memcpy time.

Then a growing session of `--turns` turns registers its chain each turn
through a worker's tiers (L2 + the L3 upload queue) and reports the bytes
PUT to S3 over the session's unique KV bytes (`l3_write_amplification`)
and the S3 requests per turn. Timed runs alternate with their memcpy
baseline and keep the best of `--repeats`.

    kvmesh bench datapath --geometry 8b --context 16384 --turns 30 --json
"""

from __future__ import annotations

import asyncio
import gc
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from kvmesh.bench import datapath_paths as paths
from kvmesh.bench.kv_chain import ChainSpec, chain_blocks
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import load_model
from kvmesh.engine.presets import write_preset
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.sim.recompute_model import GEOMETRIES, describe, recompute_s
from kvmesh.stack.servers import NatsServer, S3Server
from kvmesh.tiers.arena import HeapArena
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.l2_host import HostTier
from rich.console import Console
from rich.progress import Progress

SALT = bytes.fromhex("5a" * 16)


@dataclass(slots=True)
class DatapathConfig:
    geometry: str = "8b"
    context: int = 16384
    turns: int = 30
    repeats: int = 2
    mfu: float = 0.5
    seed: int = 0


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _memcpy_s(l2: HostTier, hashes: list[bytes], dst: torch.Tensor) -> float:
    """One pass copying every block's payload (single-threaded numpy memcpy) into a contiguous buffer."""
    out = dst.view(torch.uint8).reshape(len(hashes), -1).numpy()
    views = [l2.get(h).data.view(torch.uint8).reshape(-1).numpy() for h in hashes]
    t0 = time.perf_counter()
    for i, v in enumerate(views):
        out[i, :] = v
    return time.perf_counter() - t0


async def _best(restore, memcpy, engine: EngineLoop, hashes: list[bytes], repeats: int) -> tuple[float, float]:
    """Best restore and memcpy times over `repeats` alternating runs; the pool is emptied between runs."""
    best, best_copy = float("inf"), float("inf")
    for _ in range(repeats):
        best_copy = min(best_copy, memcpy())
        await engine.call(lambda e: e.drop_blocks(hashes))
        gc.collect()
        seconds, imported = await restore()
        if imported != len(hashes):
            raise RuntimeError(f"restore imported {imported} of {len(hashes)} blocks")
        best = min(best, seconds)
    await engine.call(lambda e: e.drop_blocks(hashes))
    return best, best_copy


async def run(cfg: DatapathConfig, progress: Progress) -> dict:
    geo = GEOMETRIES[cfg.geometry]
    with tempfile.TemporaryDirectory(prefix="kvmesh-datapath-") as tmp:
        root = Path(tmp)
        task = progress.add_task("setup: model, servers, chain", total=None)
        loaded = load_model(write_preset(root / "model", geo.preset, "llama"))
        block_size = EngineSettings().block_size
        spec = ChainSpec(loaded.fingerprint, SALT, cfg.context,
                         (loaded.config.num_layers, 2, block_size, loaded.config.num_kv_heads, loaded.config.head_dim),
                         cfg.seed)
        hashes = spec.hashes()
        engine = EngineLoop(Engine(loaded, EngineSettings(num_blocks=len(hashes) + 8, block_size=block_size)))
        engine.start()
        nats_server, s3 = NatsServer(data_dir=root / "nats"), S3Server(data_dir=root / "s3")
        nats_server.start()
        s3.start()
        try:
            l2 = HostTier(1 << 42, LRUPolicy(), loaded.fingerprint, "bench-local", HeapArena())
            for kb in chain_blocks(spec):
                l2.put_encoded(encode_kv_block(kb, loaded.fingerprint))
            nbytes = sum(l2.get(h).data.numel() * 2 for h in hashes)
            dst = torch.empty(nbytes // 2, dtype=torch.bfloat16)
            memcpy = partial(_memcpy_s, l2, hashes, dst)
            env = paths.Env(engine, spec, hashes, l2, nats_server.url, s3)
            results: dict[str, tuple[float, float]] = {}
            progress.update(task, total=1, completed=1)
            for name, restore in (("l2", paths.restore_l2), ("l3", paths.restore_l3), ("peer", paths.restore_peer),
                                  ("handoff", paths.handoff)):
                step = progress.add_task(f"restore: {name}", total=None)
                async with restore(env) as run_once:
                    results[name] = await _best(run_once, memcpy, engine, hashes, cfg.repeats)
                progress.update(step, total=1, completed=1)
            del memcpy, dst
            l2.close()
            step = progress.add_task(f"growing session: {cfg.turns} turns", total=cfg.turns)
            writes = await paths.growing_session(env, cfg.turns, nbytes, root, lambda: progress.advance(step))
        finally:
            engine.stop()
            s3.stop()
            nats_server.stop()
    memcpy_s = min(copy for _, copy in results.values())
    out = {
        "geometry": cfg.geometry,
        "preset": geo.preset,
        "context_tokens": len(hashes) * block_size,
        "kv_bytes_per_token": loaded.config.kv_bytes_per_token(),
        "context_bytes": nbytes,
        "memcpy_gbps": _gbps(nbytes, memcpy_s),
    }
    recompute = recompute_s(geo, len(hashes) * block_size, cfg.mfu)
    for name in ("l2", "peer", "l3"):
        seconds, copy = results[name]
        out[f"{name}_restore_s"] = round(seconds, 4)
        out[f"{name}_restore_gbps"] = _gbps(nbytes, seconds)
        out[f"{name}_restore_vs_memcpy"] = round(copy / seconds, 3)
        out[f"{name}_vs_h200_recompute"] = round(seconds / recompute, 3)
    seconds, copy = results["handoff"]
    out |= {"handoff_s": round(seconds, 4), "handoff_path": "same-host shared memory",
            "handoff_vs_memcpy": round(seconds / copy, 3), "handoff_vs_h200_recompute": round(seconds / recompute, 3)}
    out |= writes
    out["beats_h200_recompute"] = {t: out[f"{t}_vs_h200_recompute"] < 1 for t in ("l2", "peer", "l3", "handoff")}
    out["h200_recompute_model"] = describe(geo, len(hashes) * block_size, cfg.mfu)
    out["product_path"] = PRODUCT_PATH
    return out


# Where each row sits on the path a request takes through `kvmesh up` (a part, not the whole: `kvmesh bench
# handoff` times the handoff as a client sees it, `kvmesh bench peer` the whole request against vLLM).
PRODUCT_PATH = {
    "l2": "a worker reaching its own L2 for a prompt's prefix (prefix_reach / kv_fetch), after L1 missed; "
          "verify + import into the pool, no compute",
    "peer": "a prefill worker reaching another host's worker's L2 over NATS (prefix_worker / index lookup); "
            "on one host the same step reads shared memory instead",
    "l3": "a worker restoring a prefix from object storage (after restarts, or what no worker holds); "
          "pipelined chunk GETs + import",
    "handoff": "the decode worker fetching a prompt's whole KV from the prefill worker's L2 after the DecodeJob, "
               "with no streaming ahead (workers.stream_handoff off); under kvmesh up most of it moves while "
               "the prompt is still prefilled: see kvmesh bench handoff",
    "l3_write_amplification": "the L3 upload queue behind every store (off the token path: lowest priority, "
                              "deferred while a worker serves)",
}


def run_datapath_bench(cfg: DatapathConfig) -> dict:
    with Progress(console=Console(stderr=True), transient=True) as progress:
        return asyncio.run(run(cfg, progress))
