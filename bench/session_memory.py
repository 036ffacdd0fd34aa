"""A long session at real KV geometry through real worker processes: does every worker stay in its memory?

Starts nats-server, the S3 server, one prefill and one decode worker on the
`llama3-8b` preset (128 KiB of bf16 KV per token: a 16k-token context is
2 GiB per copy), then drives them over NATS as the ingress does:

1. turn 1: a `--context`-token prompt: prefill -> handoff -> decode;
2. turn 2: the prompt + answer + `--new-tokens` more: a prefix hit;
3. the prefill worker is stopped and a fresh one (nothing in memory, no
   peers to ask) takes turn 3, restoring the chain from L3.

Each worker's peak RSS (`VmHWM`, which counts the shared-memory L2 pages
it touched) is reported next to its configured pools (the KV pool and the
L2 capacity), with each turn's cached tokens and time. Cache transparency at
this geometry is checked by tests/serving/test_real_geometry.py (a short
context, where a reference run is affordable on a CPU). Prints one JSON
object.

    python -m kvmesh.bench.session_memory [--context 16384] [--new-tokens 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nats
import torch
from kvmesh.engine.presets import write_preset
from kvmesh.protocol import subjects
from kvmesh.protocol.serving import PrefillJob, SamplingSpec, TokenEvent
from kvmesh.protocol.streams import declare_all
from kvmesh.stack.servers import ManagedProcess, NatsServer, S3Server, spawn_process
from minio import Minio
from rich.console import Console

BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = 131072
BUCKET = "kvmesh-session-memory"
SALT = "f6" * 32
console = Console(stderr=True)


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


class Workers:
    def __init__(self, root: Path, nats_url: str, s3: S3Server, model: Path, pool_blocks: int, l2_bytes: int) -> None:
        self.root = root
        self.env = dict(os.environ) | {
            "KVMESH_NATS_URL": nats_url, "KVMESH_S3_ENDPOINT": s3.endpoint, "KVMESH_S3_ACCESS_KEY": s3.access_key,
            "KVMESH_S3_SECRET_KEY": s3.secret_key, "KVMESH_S3__BUCKET": BUCKET, "KVMESH_MODEL_DIR": str(model),
            "KVMESH_STATE_DIR": str(root / "state"), "KVMESH_SERVICE__HTTP_PORT": "0",
            "KVMESH_ENGINE__BLOCK_SIZE": str(BLOCK_SIZE), "KVMESH_ENGINE__NUM_BLOCKS": str(pool_blocks),
            "KVMESH_TIERS__L2_CAPACITY_BYTES": str(l2_bytes), "KVMESH_TIERS__L3_TAIL_DELAY_S": "1",
            "KVMESH_LOG_LEVEL": "info"}
        self.procs: dict[str, ManagedProcess] = {}

    def start(self, role: str, worker_id: str, **extra: str) -> ManagedProcess:
        env = self.env | {"KVMESH_SERVICE__WORKER_ID": worker_id} | extra
        proc = spawn_process(worker_id, [sys.executable, "-m", f"kvmesh.services.{role}"], self.root / f"{worker_id}.log",
                             detach=False, env=env)
        self.procs[worker_id] = proc
        end = time.monotonic() + 300
        while '"service ready"' not in proc.log_path.read_text(errors="replace"):
            if proc.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{worker_id} did not start: {proc.log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.proc.poll() is None:
                proc.stop(grace_s=10)


async def run_turn(nc, prefill: str, decode: str, prompt: list[int], max_tokens: int) -> tuple[list[int], TokenEvent]:
    rid = f"mem-{time.monotonic_ns()}"
    tokens: dict[int, int] = {}
    done: asyncio.Future[TokenEvent] = asyncio.get_running_loop().create_future()

    async def on_event(msg) -> None:
        ev = TokenEvent.from_bytes(msg.data)
        for i, tok in enumerate(ev.token_ids):
            tokens.setdefault(ev.seq + i, tok)
        if ev.finished and not done.done():
            done.set_result(ev)

    sub = await nc.subscribe(subjects.tokens(rid), cb=on_event)
    job = PrefillJob(request_id=rid, tenant="bench", tenant_salt=SALT, prompt_ids=prompt,
                     sampling=SamplingSpec(max_tokens=max_tokens), decode_worker=decode, deadline=time.time() + 3600)
    await nc.jetstream().publish(subjects.jobs_prefill(prefill), job.to_bytes(), headers={"Nats-Msg-Id": rid})
    final = await asyncio.wait_for(done, 3600)
    await sub.unsubscribe()
    if final.error:
        raise RuntimeError(f"turn failed: {final.error}")
    return [tokens[i] for i in range(len(tokens))], final


async def session(args: argparse.Namespace, root: Path) -> dict:
    model = write_preset(root / "model", "llama3-8b", "llama")
    pool_blocks = (args.context + args.new_tokens + 256) // BLOCK_SIZE + 8
    pool_bytes = pool_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    l2_bytes = int(pool_bytes * 1.1)
    nats_server, s3 = NatsServer(data_dir=root / "nats"), S3Server(data_dir=root / "s3")
    nats_server.start()
    s3.start()
    s3.ensure_bucket(BUCKET)
    workers = Workers(root, nats_server.url, s3, model, pool_blocks, l2_bytes)
    try:
        nc = await nats.connect(nats_server.url)
        await declare_all(nc.jetstream())
        console.print("starting workers")
        pf, dc = workers.start("prefill", "mem-pf"), workers.start("decode", "mem-dc")
        prompt = torch.randint(0, 1000, (args.context,), generator=torch.Generator().manual_seed(5)).tolist()
        turns = []
        t0 = time.monotonic()
        console.print(f"turn 1: {len(prompt)} tokens")
        out1, f1 = await run_turn(nc, "mem-pf", "mem-dc", prompt, 8)
        turns.append({"prompt_tokens": len(prompt), "cached_tokens": f1.cached_tokens, "s": round(time.monotonic() - t0, 1)})
        p2 = prompt + out1 + list(range(100, 100 + args.new_tokens))
        t0 = time.monotonic()
        console.print(f"turn 2: {len(p2)} tokens")
        out2, f2 = await run_turn(nc, "mem-pf", "mem-dc", p2, 8)
        turns.append({"prompt_tokens": len(p2), "cached_tokens": f2.cached_tokens, "s": round(time.monotonic() - t0, 1)})
        peaks = {"prefill": peak_rss(pf.pid), "decode": peak_rss(dc.pid)}
        client = Minio(s3.endpoint, s3.access_key, s3.secret_key, secure=False)
        want = len(p2) // 256
        end = time.monotonic() + 600
        while sum(1 for _ in client.list_objects(BUCKET, recursive=True)) < want and time.monotonic() < end:
            await asyncio.sleep(0.5)
        pf.stop(grace_s=30)
        console.print("turn 3: a fresh prefill worker restores from L3")
        fresh = workers.start("prefill", "mem-pf-fresh", KVMESH_WORKERS__PROBE_PEERS="false")
        p3 = p2 + out2 + list(range(200, 232))
        t0 = time.monotonic()
        out3, f3 = await run_turn(nc, "mem-pf-fresh", "mem-dc", p3, 8)
        turns.append({"prompt_tokens": len(p3), "cached_tokens": f3.cached_tokens, "s": round(time.monotonic() - t0, 1)})
        peaks["prefill_restarted"] = peak_rss(fresh.pid)
        peaks["decode"] = peak_rss(dc.pid)
        await nc.drain()
    finally:
        workers.stop_all()
        s3.stop()
        nats_server.stop()
    budget = pool_bytes + l2_bytes
    gib = 2**30
    return {
        "geometry": "8b", "context_tokens": args.context, "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "context_kv_gib": round(args.context * KV_BYTES_PER_TOKEN / gib, 3),
        "pool_gib": round(pool_bytes / gib, 3), "l2_capacity_gib": round(l2_bytes / gib, 3),
        "turns": turns,
        "peak_rss_gib": {k: round(v / gib, 3) for k, v in peaks.items()},
        "peak_rss_over_pools_gib": {k: round((v - budget) / gib, 3) for k, v in peaks.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-session-memory-") as tmp:
        print(json.dumps(asyncio.run(session(args, Path(tmp)))))


if __name__ == "__main__":
    main()
