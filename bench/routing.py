"""Prefill routing modes side by side: the serve workload on 2 prefill workers, `cost` vs `load` vs `round_robin`.

`python -m kvmesh.bench.routing [--sessions N --turns T --concurrency C]`. For each
mode (`KVMESH_INGRESS__ROUTING`) a fresh stack (`kvmesh up`, cache-index and
L3 on, 2 prefill + 1 decode) runs the same multi-turn agent workload
(bench/serve_workload.py, sessions carry a prompt_cache_key); figures per
mode as in bench/serve.py (TTFT p50/p99, cached-token ratio ...), then ratios
against `cost`. Progress on stderr, one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvmesh.bench.serve import (
    REPO_ROOT,
    ServeBenchConfig,
    drive,
    running_stack,
    summarize,
)
from kvmesh.bench.serve_workload import build_workload
from rich.console import Console

MODES = ("cost", "load", "round_robin")


@contextmanager
def routing_mode(mode: str) -> Iterator[None]:
    """`kvmesh up` passes this process's environment to the services it starts."""
    old = os.environ.get("KVMESH_INGRESS__ROUTING")
    os.environ["KVMESH_INGRESS__ROUTING"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVMESH_INGRESS__ROUTING", None)
        else:
            os.environ["KVMESH_INGRESS__ROUTING"] = old


def run_routing_bench(cfg: ServeBenchConfig) -> dict:
    say = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-model-") as tmp:
        from kvmesh.engine.presets import write_preset

        model_dir = cfg.model_dir or write_preset(Path(tmp) / cfg.preset, cfg.preset, "llama", seed=0)
        w = build_workload(cfg.sessions, cfg.turns, REPO_ROOT)
        result: dict = {"workload": w.source, "sessions": len(w.sessions), "turns": cfg.turns,
                        "concurrency": cfg.concurrency, "prefill_workers": cfg.prefill, "model": model_dir.name}
        for mode in MODES:
            with routing_mode(mode), running_stack(model_dir, cfg, True, say) as url:
                samples, wall = asyncio.run(drive(url, model_dir.name, w, cfg, say, mode))
                result[mode] = summarize(samples, wall)
        base = result["cost"]
        for mode in MODES[1:]:
            result[f"ttft_p50_ratio_{mode}_vs_cost"] = round(result[mode]["ttft_ms_p50"] / max(base["ttft_ms_p50"], 1e-9), 3)
            result[f"cached_ratio_{mode}_vs_cost"] = round(result[mode]["cached_token_ratio"]
                                                           / max(base["cached_token_ratio"], 1e-9), 3)
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    a = p.parse_args()
    cfg = ServeBenchConfig(sessions=a.sessions, turns=a.turns, concurrency=a.concurrency, max_tokens=a.max_tokens,
                           prefill=2, decode=1, overhead_sessions=0)
    print(json.dumps(run_routing_bench(cfg), indent=2))


if __name__ == "__main__":
    main()
