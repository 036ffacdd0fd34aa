"""`kvmesh bench engine`: what prefix reuse buys, decode speed vs HF transformers, KV bytes per token.

(a) TTFT of one long prompt with 0%, 50% and 90% of it already cached, and
    with the cache off; `prefill_speedup_90pct_hit` = cache-off / 90%-hit.
(b) Decode tokens/s (from the batch's first generated token to its last;
    greedy, same prompts and new tokens) of the engine vs HF `generate` at
    several batch sizes; `e2e_*` figures include the prefill.
(c) Bytes per token of the engine's KV pool vs 2 * L * Hkv * D * itemsize.
Every figure is a median over `repeats` runs after a warm-up, with the
compared cases taking turns (the machine may be shared); progress goes to
stderr, the result is one JSON object.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.sampling import SamplingParams
from rich.console import Console
from rich.progress import Progress

CACHED_FRACTIONS = (0.0, 0.5, 0.9)


@dataclass(frozen=True, slots=True)
class EngineBenchConfig:
    model_dir: Path | None = None  # None: write the `small` preset to a temp dir
    prompt_tokens: int = 2048
    decode_prompt_tokens: int = 128
    decode_tokens: int = 32
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    block_size: int = 16
    repeats: int = 3
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = torch's default


def _random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(5, vocab) for _ in range(n)]


def _interleaved(runs: dict[str, Callable[[int], float]], repeats: int, advance: Callable[[], None]) -> dict[str, float]:
    """Median seconds per case; the cases take turns each repeat, so load from other processes hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats):
        for name, run in runs.items():
            times[name].append(run(i))
            advance()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _engine(loaded: LoadedModel, cfg: EngineBenchConfig, cache: bool, tokens: int) -> Engine:
    settings = EngineSettings(
        block_size=cfg.block_size,
        num_blocks=tokens // cfg.block_size + 64,
        max_num_seqs=max(cfg.batch_sizes),
        max_num_batched_tokens=max(cfg.prompt_tokens, cfg.decode_prompt_tokens * max(cfg.batch_sizes)),
        enable_prefix_caching=cache,
    )
    return Engine(loaded, settings)


def bench_ttft(loaded: LoadedModel, cfg: EngineBenchConfig, progress: Progress) -> dict[str, float]:
    """Seconds to the first token of a prompt whose leading fraction is cached (a fresh prompt per run)."""
    vocab = loaded.config.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    cases = [("cache_off", 0.0, False)] + [(f"hit_{int(f * 100)}pct", f, True) for f in CACHED_FRACTIONS]
    task = progress.add_task("TTFT", total=len(cases) * cfg.repeats)
    runs: dict[str, Callable[[int], float]] = {}
    for name, frac, cache in cases:
        engine = _engine(loaded, cfg, cache, 2 * cfg.prompt_tokens)
        engine.generate([_random_prompt(random.Random(name), 256, vocab)], one)  # warm-up

        def run(i: int, engine: Engine = engine, name: str = name, frac: float = frac) -> float:
            rng = random.Random(f"{cfg.seed}-{name}-{i}")
            prompt = _random_prompt(rng, cfg.prompt_tokens, vocab)
            cached = int(frac * cfg.prompt_tokens)
            if cached:  # an earlier request that shares the first `cached` tokens
                engine.generate([prompt[:cached] + [rng.randrange(5, vocab)]], one)
            result = engine.generate([prompt], one)[0]
            if result.cached_tokens < cached - cfg.block_size:
                raise RuntimeError(f"{name}: only {result.cached_tokens} of {cached} tokens hit")
            return result.ttft

        runs[name] = run
    return _interleaved(runs, cfg.repeats, lambda: progress.advance(task))


@dataclass(slots=True)
class _Timing:
    total_s: float  # the whole generate call, prefill included
    decode_s: float  # from the first generated token of the batch to the last
    decode_cpu_s: float  # the same span in process CPU time: steadier when other processes load the machine


def _engine_generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> _Timing:
    t0 = time.perf_counter()
    ids = [f"b{t0}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    t_first = c_first = 0.0
    while engine.has_unfinished():
        for out in engine.step():
            started.add(out.request_id)
        if not t_first and len(started) == len(ids):
            t_first, c_first = time.perf_counter(), time.process_time()
    t_end, c_end = time.perf_counter(), time.process_time()
    return _Timing(t_end - t0, t_end - t_first, c_end - c_first)


def _hf_generate(hf: torch.nn.Module, prompts: list[list[int]], new: int) -> _Timing:
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """put() gets the prompt first, then each step's tokens."""

        def __init__(self) -> None:
            self.puts: list[tuple[float, float]] = []

        def put(self, value: torch.Tensor) -> None:
            self.puts.append((time.perf_counter(), time.process_time()))

        def end(self) -> None:
            self.puts.append((time.perf_counter(), time.process_time()))

    clock = Clock()
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
    t_end, c_end = time.perf_counter(), time.process_time()
    return _Timing(t_end - t0, t_end - clock.puts[1][0], c_end - clock.puts[1][1])


def bench_decode(loaded: LoadedModel, cfg: EngineBenchConfig, progress: Progress) -> dict:
    """Tokens/s for the engine and HF `generate` at each batch size: decode only, and end to end."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=loaded.config.dtype, local_files_only=True).eval()
    vocab = loaded.config.vocab_size
    params = SamplingParams(max_tokens=cfg.decode_tokens, ignore_eos=True, detokenize=False)
    task = progress.add_task("decode", total=len(cfg.batch_sizes) * 2 * cfg.repeats)
    out: dict[str, dict[str, float]] = {}
    for b in cfg.batch_sizes:
        engine = _engine(loaded, cfg, False, b * (cfg.decode_prompt_tokens + cfg.decode_tokens))

        def prompts(i: int, b: int = b) -> list[list[int]]:
            rng = random.Random(f"{cfg.seed}-decode-{b}-{i}")
            return [_random_prompt(rng, cfg.decode_prompt_tokens, vocab) for _ in range(b)]

        warm = prompts(-1)
        _engine_generate(engine, warm, SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False))
        _hf_generate(hf, warm, 2)
        timings: dict[str, list[_Timing]] = {"engine": [], "hf": []}
        for i in range(cfg.repeats):  # the two take turns: load from other processes hits both alike
            timings["engine"].append(_engine_generate(engine, prompts(i), params))
            progress.advance(task)
            timings["hf"].append(_hf_generate(hf, prompts(i), cfg.decode_tokens))
            progress.advance(task)
        decode_tokens = b * (cfg.decode_tokens - 1)
        rate = {
            who: (
                decode_tokens / statistics.median(t.decode_s for t in ts),
                b * cfg.decode_tokens / statistics.median(t.total_s for t in ts),
                decode_tokens / statistics.median(t.decode_cpu_s for t in ts),
            )
            for who, ts in timings.items()
        }
        out[f"batch_{b}"] = {
            "engine_decode_tok_s": rate["engine"][0],
            "hf_decode_tok_s": rate["hf"][0],
            "ratio": rate["engine"][0] / rate["hf"][0],
            "engine_e2e_tok_s": rate["engine"][1],
            "hf_e2e_tok_s": rate["hf"][1],
            "e2e_ratio": rate["engine"][1] / rate["hf"][1],
            "cpu_time_ratio": rate["engine"][2] / rate["hf"][2],  # decode tokens per CPU-second
        }
    return out


def bench_kv_bytes(loaded: LoadedModel, cfg: EngineBenchConfig) -> dict:
    engine = _engine(loaded, cfg, True, cfg.prompt_tokens)
    c = loaded.config
    measured = engine.kv_cache.numel() * engine.kv_cache.element_size() / (
        engine.settings.num_blocks * engine.settings.block_size
    )
    formula = 2 * c.num_layers * c.num_kv_heads * c.head_dim * engine.kv_cache.element_size()
    return {"measured": measured, "formula": formula, "ratio": measured / formula}


def run_engine_bench(cfg: EngineBenchConfig) -> dict:
    console = Console(stderr=True)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        model_dir = cfg.model_dir
        if model_dir is None:
            from kvmesh.engine.presets import write_preset

            console.print("writing the small preset ...")
            model_dir = write_preset(Path(tmp) / "small", "small", "llama", seed=cfg.seed)
        loaded = load_model(model_dir)
        with Progress(console=console, transient=True) as progress:
            ttft = bench_ttft(loaded, cfg, progress)
            decode = bench_decode(loaded, cfg, progress)
    kv = bench_kv_bytes(loaded, cfg)
    ratio_b8 = decode.get("batch_8", {}).get("ratio")
    return {
        "model": "small preset" if cfg.model_dir is None else str(cfg.model_dir),
        "torch_threads": torch.get_num_threads(),
        "repeats": cfg.repeats,
        "prompt_tokens": cfg.prompt_tokens,
        "ttft_s": ttft,
        "prefill_speedup_50pct_hit": ttft["cache_off"] / ttft["hit_50pct"],
        "prefill_speedup_90pct_hit": ttft["cache_off"] / ttft["hit_90pct"],
        "decode": {"prompt_tokens": cfg.decode_prompt_tokens, "new_tokens": cfg.decode_tokens, **decode},
        "decode_throughput_ratio_vs_hf_batch8": ratio_b8,
        "kv_bytes_per_token": kv,
    }
