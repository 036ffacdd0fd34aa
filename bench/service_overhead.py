"""Fixed latency of the service path: TTFT through the services vs the in-process engine, per hop.

Starts a stack of its own (`kvmesh up --detach`, tiny preset, 1 prefill + 1
decode worker, temp state dir), then sends N sequential streaming
`/v1/completions` requests per prompt size and max_tokens (1: the prefill
answers alone; 2: the first token of a request that is handed off) and runs
the same prompt ids through an in-process `Engine`. A core-NATS tap on the
job, handoff and token subjects timestamps each hop as it crosses the bus
(same clock as the client), so the report splits the service TTFT into
client->job published, job->first token event, token event->client, and
first token->handoff. Prompts are unique per request (no cache hits on
either side). Progress on stderr, one JSON object on stdout.

    .venv/bin/python -m kvmesh.bench.service_overhead [--requests 20] [--sizes 16,128,512] [--spans]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvmesh.bench.serve import _pct
from rich.console import Console

KEY = "sk-bench-overhead"


@contextmanager
def stack(model_dir: Path, say: Console, log_level: str) -> Iterator[tuple[str, str, Path]]:
    """(ingress base URL, NATS URL with the admin's credentials, state dir) of a stack of our own; always `kvmesh down`."""
    from kvmesh.credentials.nats import admin_auth
    from kvmesh.net import free_port
    from kvmesh.stack.state import load_state

    kvmesh = str(Path(sys.executable).parent / "kvmesh")
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-overhead-") as tmp:
        port = free_port()
        env = {**os.environ, "KVMESH_API_KEYS": f"{KEY}:bench", "KVMESH_INGRESS__PORT": str(port),
               "KVMESH_LOG_LEVEL": log_level, "KVMESH_INGRESS__RATE_LIMIT_PER_S": "1000",
               "KVMESH_INGRESS__RATE_LIMIT_BURST": "1000"}
        args = [kvmesh, "up", "--detach", "--model", str(model_dir), "--state-dir", tmp, "--nats-port", "0",
                "--nats-monitor-port", "0", "--s3-port", "0", "--prefill", "1", "--decode", "1", "--timeout", "900"]
        say.log("starting a stack")
        try:
            up = subprocess.run(args, env=env, capture_output=True, text=True, timeout=960)
            if up.returncode != 0:
                raise RuntimeError(f"kvmesh up failed ({up.returncode}): {up.stderr[-2000:]}")
            state = load_state(Path(tmp))
            assert state is not None
            admin = admin_auth(Path(tmp))  # the stack's NATS has users: the tap reads as its admin
            yield f"http://127.0.0.1:{port}/v1", admin.server_url(state.nats_url) if admin else state.nats_url, Path(tmp)
        finally:
            subprocess.run([kvmesh, "down", "--state-dir", tmp], env=env, capture_output=True, timeout=120)


class Tap:
    """Arrival time (perf_counter) of each request's job, handoff and token events on the bus."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, float]] = defaultdict(dict)

    async def start(self, nats_url: str):
        import nats
        from kvmesh.protocol import subjects
        from kvmesh.protocol.serving import DecodeJob, PrefillJob, TokenEvent

        nc = await nats.connect(nats_url)

        def stamp(kind: str, model):
            async def cb(msg) -> None:
                now = time.perf_counter()
                m = model.from_bytes(msg.data)
                key = f"{kind}{m.seq}" if kind == "tok" else kind
                self.seen[m.request_id].setdefault(key, now)
            return cb

        await nc.subscribe(subjects.JOBS_ALL, cb=stamp("job", PrefillJob))
        await nc.subscribe(subjects.HANDOFF_ALL, cb=stamp("handoff", DecodeJob))
        await nc.subscribe(subjects.TOKENS_ALL, cb=stamp("tok", TokenEvent))
        return nc


async def service_ttft(client, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    """(start, first text chunk time, request id) of one streaming /v1/completions request."""
    started = time.perf_counter()
    first = None
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", "/completions", json=body) as r:
        r.raise_for_status()
        rid = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if c.get("text"):
                    first = first or time.perf_counter()
    return started, first or time.perf_counter(), rid


async def measure(url: str, nats_url: str, model_dir: Path, sizes: list[int], n: int, say: Console) -> dict:
    import httpx
    from kvmesh.config import EngineSettings
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.loader import load_model
    from kvmesh.engine.sampling import SamplingParams
    from kvmesh.ingress.core.prompt import PromptBuilder

    loaded = load_model(model_dir)
    engine = Engine(loaded, EngineSettings())
    prompts = PromptBuilder(loaded.tokenizer, 1024, loaded.config.eos_token_ids)

    def engine_ttft(ids: list[int], max_tokens: int) -> float:
        rid = f"e{time.perf_counter_ns()}"
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        ttft = None
        while engine.has_unfinished():
            for o in engine.step():
                ttft = o.ttft if ttft is None and o.ttft is not None else ttft
        assert ttft is not None
        return ttft

    tap = Tap()
    nc = await tap.start(nats_url)
    words = "the quick brown fox jumps over a lazy dog while agents call tools and read files".split()
    out: dict = {}
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as client:
        await service_ttft(client, "warm up", 2)
        for size in sizes:
            for max_tokens in (1, 2):
                rows = defaultdict(list)
                for i in range(n):
                    text = f"[{size}x{max_tokens}n{i}t{time.time_ns()}] " + " ".join(words[(i + k) % len(words)] for k in range(size))
                    ids = prompts.encode(text)[:size]
                    text = loaded.tokenizer.decode(ids)
                    start, first, rid = await service_ttft(client, text, max_tokens)
                    e = await asyncio.to_thread(engine_ttft, prompts.encode(text), max_tokens)
                    await asyncio.sleep(0.05)  # let the tap see the handoff
                    rows["service_ttft_ms"].append((first - start) * 1000)
                    rows["engine_ttft_ms"].append(e * 1000)
                    rows["overhead_ms"].append((first - start - e) * 1000)
                    seen = tap.seen.get(rid, {})
                    if "job" in seen and "tok0" in seen:
                        rows["client_to_job_ms"].append((seen["job"] - start) * 1000)
                        rows["job_to_token0_ms"].append((seen["tok0"] - seen["job"]) * 1000)
                        rows["token0_to_client_ms"].append((first - seen["tok0"]) * 1000)
                    if "handoff" in seen and "tok0" in seen:
                        rows["token0_to_handoff_ms"].append((seen["handoff"] - seen["tok0"]) * 1000)
                    if "tok1" in seen and "handoff" in seen:
                        rows["handoff_to_token1_ms"].append((seen["tok1"] - seen["handoff"]) * 1000)
                key = f"prompt{size}_max{max_tokens}"
                out[key] = {k: {"p50": round(_pct(v, 0.5), 2), "p99": round(_pct(v, 0.99), 2)}
                            for k, v in rows.items()}
                say.log(f"{key}: overhead p50 {out[key]['overhead_ms']['p50']} ms", highlight=False)
    await nc.close()
    over = [v["overhead_ms"]["p50"] for v in out.values()]
    return {"requests_per_case": n, "cases": out, "service_overhead_ms_p50_median_of_cases": round(_pct(over, 0.5), 2)}


def prefill_spans(state_dir: Path) -> dict:
    """p50 of the prefill worker's own spans (its `prefilled` log lines: reach, engine, token0, store)."""
    spans = defaultdict(list)
    for path in (state_dir / "logs").glob("prefill*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if '"prefilled"' in line:
                for k, v in json.loads(line).get("ms", {}).items():
                    spans[k].append(v)
    return {f"prefill_{k}_ms_p50": round(_pct(v, 0.5), 2) for k, v in spans.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--sizes", default="16,128,512")
    ap.add_argument("--spans", action="store_true", help="info logs in the stack: the prefill worker's spans too")
    a = ap.parse_args()
    say = Console(stderr=True)
    from kvmesh.engine.presets import write_preset

    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-model-") as tmp:
        model_dir = write_preset(Path(tmp) / "tiny", "tiny", "llama", seed=0)
        with stack(model_dir, say, "info" if a.spans else "warning") as (url, nats_url, state_dir):
            result = asyncio.run(measure(url, nats_url, model_dir, [int(s) for s in a.sizes.split(",")],
                                         a.requests, say))
            if a.spans:
                result["prefill_spans_all_cases"] = prefill_spans(state_dir)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
