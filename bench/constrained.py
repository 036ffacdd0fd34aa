"""`kvmesh bench constrained`: what grammar masks cost a decode step, constrained vs unconstrained.

Same engine, same prompts, same run: a batch of B requests decodes N tokens
unconstrained (ignore_eos, so every row runs N steps) and then the same
batch with every row constrained to a JSON array of 200 small objects (so
no row's grammar completes early). The figure is
seconds per decode step from the batch's first token to its last, median
over repeats with the cases taking turns; `overhead_bB` = constrained /
unconstrained - 1. Masks are filled on a thread during the forward
(`overlap`) and, for comparison, inline (`overhead_bB_inline`). On a CPU the
tiny models' whole forward is a millisecond or two, so the same mask work is
also put next to a modeled H200 decode step of Llama-3-8B
(`modeled_h200_8b_overhead_bB`, the model printed). The grammar
libraries themselves are compared in bench/grammar_libs.py.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from kvmesh.config import ConstraintSettings, EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import load_model
from kvmesh.engine.sampling import SamplingParams
from kvmesh.protocol.serving import Constraint
from rich.console import Console
from rich.progress import Progress

# A long, fixed-shape JSON array: every row must write many tokens before the grammar can close.
SCHEMA = {"type": "array", "minItems": 200, "maxItems": 200,
          "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 24}, "v": {"type": "integer"}},
                    "required": ["k", "v"]}}

# A decode step of Llama-3-8B on an H200 is bound by reading every bf16 weight once per step
# (4.8 TB/s HBM, 70% achieved): ~4.8 ms at small batches.
H200_8B_DECODE_STEP_S = 8.03e9 * 2 / (4.8e12 * 0.7)


@dataclass(frozen=True, slots=True)
class ConstrainedBenchConfig:
    model_dir: Path | None = None  # None: write `preset` to a temp dir
    preset: str = "tiny"
    batch_sizes: tuple[int, ...] = (1, 8)
    decode_tokens: int = 64
    prompt_tokens: int = 64
    repeats: int = 5
    threads: int = 0


def _step_seconds(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Seconds per decode step: from the step that gave every row its first token to the last."""
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    first = start = None
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        if start is None and outs:
            start = time.perf_counter()
            first = steps
        steps += 1
    assert start is not None and first is not None
    return (time.perf_counter() - start) / max(steps - first - 1, 1)


def run_constrained_bench(cfg: ConstrainedBenchConfig) -> dict:
    console = Console(stderr=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = cfg.model_dir
        if model_dir is None:
            from kvmesh.engine.presets import write_preset

            console.log(f"writing the {cfg.preset} preset")
            model_dir = write_preset(Path(tmp) / cfg.preset, cfg.preset)
        loaded = load_model(model_dir)
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    constraint = Constraint(kind="json", json_schema=SCHEMA).model_dump_json()
    plain = SamplingParams(max_tokens=cfg.decode_tokens, ignore_eos=True, detokenize=False)
    constrained = SamplingParams(max_tokens=cfg.decode_tokens, ignore_eos=True, detokenize=False, constraint=constraint)
    engines = {
        overlap: Engine(loaded, EngineSettings(num_blocks=1024, constraints=ConstraintSettings(overlap_masks=overlap)))
        for overlap in (True, False)
    }
    result: dict = {"preset": cfg.preset if cfg.model_dir is None else str(cfg.model_dir), "vocab_size": vocab,
                    "decode_tokens": cfg.decode_tokens, "repeats": cfg.repeats, "torch_threads": torch.get_num_threads(),
                    "step_ms": {}}
    cases = {"plain": (engines[True], plain), "constrained": (engines[True], constrained),
             "constrained_inline": (engines[False], constrained)}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decode steps", total=len(cfg.batch_sizes) * (cfg.repeats + 1) * len(cases))
        for b in cfg.batch_sizes:
            times: dict[str, list[float]] = {name: [] for name in cases}
            for rep in range(cfg.repeats + 1):  # repeat 0 warms up (grammar compile, allocator)
                prompts = [[rng.randrange(8, vocab) for _ in range(cfg.prompt_tokens)] for _ in range(b)]
                for name, (engine, params) in cases.items():
                    seconds = _step_seconds(engine, prompts, params)
                    if rep:
                        times[name].append(seconds)
                    progress.advance(task)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            result["step_ms"][f"b{b}"] = {name: round(s * 1000, 3) for name, s in med.items()}
            result[f"overhead_b{b}"] = round(med["constrained"] / med["plain"] - 1, 4)
            result[f"overhead_b{b}_inline"] = round(med["constrained_inline"] / med["plain"] - 1, 4)
            # What a GPU user faces: the mask work measured here (inline, none of it hidden) next to a
            # modeled Llama-3-8B decode step on an H200.
            mask_s = max(med["constrained_inline"] - med["plain"], 0.0)
            result[f"modeled_h200_8b_overhead_b{b}"] = round(mask_s / H200_8B_DECODE_STEP_S, 4)
    result["modeled_h200_8b_decode_step_ms"] = round(H200_8B_DECODE_STEP_S * 1000, 3)
    result["model"] = ("decode step = bf16 weights read once (8.03e9 x 2 B) / (4.8 TB/s HBM x 0.7); "
                       "mask cost = this CPU's constrained_inline - plain per step, nothing overlapped")
    return result
