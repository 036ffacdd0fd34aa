"""`kvmesh bench serve`'s run: every mode on its own stack, side by side (what the bench is: bench/serve.py)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from kvmesh.bench.serve import REPO_ROOT, Sample, ServeBenchConfig, _pct, drive, running_stack, summarize
from kvmesh.bench.serve_compare import ratios, same_answers
from kvmesh.bench.serve_evidence import stack_evidence
from kvmesh.bench.serve_modes import CACHE_OFF, KVMESH, L1_ONLY, serve_modes
from kvmesh.bench.serve_overhead import overhead
from kvmesh.bench.serve_workload import build_workload
from rich.console import Console


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
                f"concurrency {cfg.concurrency}, {cfg.prefill} prefill workers, model {model}")
        result: dict = {"workload": w.source, "sessions": len(w.sessions), "turns": cfg.turns,
                        "concurrency": cfg.concurrency, "max_tokens": cfg.max_tokens, "model": model, "l3": cfg.l3,
                        "prefill_workers": cfg.prefill, "decode_workers": cfg.decode, "l1_blocks": cfg.l1_blocks}
        answers: dict[str, list[Sample]] = {}
        for mode in serve_modes():
            state = Path(tmp) / f"stack-{mode.name}"
            state.mkdir()
            say.log(f"mode {mode.name}")
            with running_stack(model_dir, cfg, mode.cache, say, dict(mode.env), state) as url:
                samples, wall = asyncio.run(drive(url, model, w, cfg, say, mode.name))
                result[mode.name] = {**summarize(samples, wall), "stack": stack_evidence(state)}
                answers[mode.name] = samples
                if mode.name == KVMESH and cfg.overhead_sessions:
                    say.log("service overhead: services vs in-process engine, one request at a time")
                    oh = asyncio.run(overhead(url, model, model_dir, w, cfg))
                    result["service_overhead_ms_p50"] = round(_pct(oh.ms, 0.5), 2)
                    result["service_overhead_ms_p50_full_hit"] = round(_pct(oh.repeat_ms, 0.5), 2)
                    result["overhead_requests"] = oh.total
                    result["overhead_identical"] = f"{oh.identical}/{oh.total}"
        result["kvmesh_vs_l1_only"] = ratios(result[KVMESH], result[L1_ONLY])
        result["kvmesh_vs_cache_off"] = ratios(result[KVMESH], result[CACHE_OFF])
        result["l1_only_vs_cache_off"] = ratios(result[L1_ONLY], result[CACHE_OFF])
        result["answers_identical"] = {f"{name}_vs_kvmesh": same_answers(answers[name], answers[KVMESH])
                                       for name in (L1_ONLY, CACHE_OFF)}
        return result
