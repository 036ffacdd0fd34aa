"""Prefill cost of a synthetic checkpoint, full vs over a cached prefix, and logit margins.

    python -m kvmesh.bench.model_prefill [--preset small] [--tokens 2048] [--cached 1536]

Prints one JSON object: parameter count, best-of-N seconds for a full prefill of
`--tokens` tokens, seconds for the same request when its first `--cached`
tokens are already in the paged KV cache (only the rest is computed), their
ratio, and the median top-2 logit gap with the max |logit| difference
between full and split prefill over random prompts (the cache-transparency
margin: the gap must dwarf the difference).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kvmesh.engine.forward_batch import ForwardBatch
from kvmesh.engine.loader import LoadedModel, load_model
from kvmesh.engine.presets import write_preset
from rich.progress import Progress

BLOCK = 16


def _batch(ids: torch.Tensor, start: int, table: torch.Tensor) -> ForwardBatch:
    """One sequence whose tokens [0, start) are cached and [start, len(ids)) are new."""
    n = ids.shape[0]
    return ForwardBatch(
        input_ids=ids[start:],
        positions=torch.arange(start, n),
        query_lens=torch.tensor([n - start], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=table[None],
        slot_mapping=(table.long()[torch.arange(start, n) // BLOCK] * BLOCK + torch.arange(start, n) % BLOCK),
        logits_indices=torch.tensor([n - start - 1]),
    )


def _kv(loaded: LoadedModel, tokens: int) -> torch.Tensor:
    c = loaded.config
    return torch.zeros(c.num_layers, 2, -(-tokens // BLOCK), BLOCK, c.num_kv_heads, c.head_dim, dtype=c.dtype)


def _timed(loaded: LoadedModel, ids: torch.Tensor, cached: int) -> float:
    table = torch.arange(-(-ids.shape[0] // BLOCK), dtype=torch.int32)
    kv = _kv(loaded, ids.shape[0])
    if cached:
        loaded.model(_batch(ids[:cached], 0, table), kv)
    start = time.perf_counter()
    loaded.model(_batch(ids, cached, table), kv)
    return time.perf_counter() - start


def _margins(loaded: LoadedModel, prompts: int, length: int, progress: Progress) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(1)
    gaps, diffs = [], []
    table = torch.arange(-(-length // BLOCK), dtype=torch.int32)
    task = progress.add_task("margins", total=prompts)
    for _ in range(prompts):
        ids = torch.randint(0, loaded.config.vocab_size, (length,), generator=gen)
        full = loaded.model(_batch(ids, 0, table), _kv(loaded, length))[0]
        kv = _kv(loaded, length)
        loaded.model(_batch(ids[: length // 2 + 3], 0, table), kv)
        split = loaded.model(_batch(ids, length // 2 + 3, table), kv)[0]
        top2 = full.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        diffs.append(float((full - split).abs().max()))
        progress.advance(task)
    return statistics.median(gaps), max(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="existing checkpoint dir (default: write the preset)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--cached", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Progress(transient=True) as progress:
        model_dir = args.model or write_preset(Path(tmp) / args.preset, args.preset, args.arch)
        loaded = load_model(model_dir)
        ids = torch.randint(0, loaded.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
        _timed(loaded, ids[:64], 0)  # warm-up
        task = progress.add_task("prefill", total=2 * args.repeats)
        full, cached = [], []
        for _ in range(args.repeats):
            full.append(_timed(loaded, ids, 0))
            progress.advance(task)
            cached.append(_timed(loaded, ids, args.cached))
            progress.advance(task)
        gap, diff = _margins(loaded, args.prompts, 128, progress)
    # Best of N: the machine is shared, and contention only ever adds time.
    full_s, cached_s = min(full), min(cached)
    print(json.dumps({
        "preset": args.preset if args.model is None else str(args.model),
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "threads": torch.get_num_threads(),
        "prefill_tokens": args.tokens,
        "full_prefill_s": round(full_s, 3),
        "cached_prefix_tokens": args.cached,
        "cached_prefill_s": round(cached_s, 3),
        "cached_vs_full_ratio": round(cached_s / full_s, 3),
        "median_top2_logit_gap": round(gap, 4),
        "max_full_vs_split_logit_diff": diff,
    }))


if __name__ == "__main__":
    main()
