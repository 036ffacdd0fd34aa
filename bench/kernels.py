"""Paged attention (torch path, and Triton on CUDA) vs plain dense SDPA on contiguous K/V.

    python -m kvmesh.bench.kernels [--device cpu|cuda] [--repeats 9] [--threads N]

Cases use the `small` preset's attention shape (Hq 12, Hkv 4, head_dim 64,
block_size 16): a 2k-token prefill, a 256-token chunk over a 1792-token
cached prefix, and decode at batch 8. Paged attention runs with block
tables shuffled across the pool (fragmented: K/V must be gathered) and with
each sequence's blocks consecutive (the torch path reads them in place). The
dense baseline is the same math on K/V that are already contiguous (no
paging, no gather; GQA by grouping query heads, as the paged decode does),
so each ratio is the cost of paging. Variants run interleaved and each keeps
its best time, so load from other work on the machine hits all alike.
Prints one JSON object; ``triton_timed`` says whether Triton kernels ran
(only on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvmesh.kernels.dispatch import ENV_VAR
from kvmesh.kernels.paged_attention import paged_attention
from rich.progress import Progress
from torch.nn.attention.bias import causal_lower_right

HQ, HKV, D, BS = 12, 4, 64, 16


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    qlen: int
    ctx: int
    num_seqs: int


CASES = (
    Case("prefill_2k", 2048, 2048, 1),
    Case("prefix_chunk_256_over_1792", 256, 2048, 1),
    Case("decode_b8_ctx1024", 1, 1024, 8),
    Case("decode_b8_ctx4096", 1, 4096, 8),
)


@dataclass(slots=True)
class Inputs:
    q: torch.Tensor  # [num_seqs * qlen, Hq, D]
    kv_layer: torch.Tensor
    tables: dict[str, torch.Tensor]  # "shuffled" / "consecutive" -> block tables
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    k: torch.Tensor  # dense [num_seqs, Hkv, ctx, D], the same keys as the pages
    v: torch.Tensor


def _inputs(case: Case, device: torch.device) -> Inputs:
    """One pool holding every sequence twice: once shuffled, once in consecutive blocks."""
    g = torch.Generator().manual_seed(0)
    nb = -(-case.ctx // BS)
    n = case.num_seqs
    k = torch.randn(n, case.ctx, HKV, D, generator=g)
    v = torch.randn(n, case.ctx, HKV, D, generator=g)
    pool = torch.zeros(2, 2 * n * nb, BS, HKV, D)
    consecutive = torch.arange(n * nb).view(n, nb)
    shuffled = (n * nb + torch.randperm(n * nb, generator=g)).view(n, nb)
    padded = torch.zeros(2, n, nb * BS, HKV, D)
    padded[0, :, : case.ctx], padded[1, :, : case.ctx] = k, v
    for ids in (consecutive, shuffled):
        pool[:, ids.flatten()] = padded.view(2, n * nb, BS, HKV, D)
    return Inputs(
        q=torch.randn(n * case.qlen, HQ, D, generator=g).to(device),
        kv_layer=pool.to(device),
        tables={"shuffled": shuffled.int().to(device), "consecutive": consecutive.int().to(device)},
        query_lens=torch.full((n,), case.qlen, dtype=torch.int32, device=device),
        context_lens=torch.full((n,), case.ctx, dtype=torch.int32, device=device),
        k=k.transpose(1, 2).contiguous().to(device),
        v=v.transpose(1, 2).contiguous().to(device),
    )


def _dense(case: Case, x: Inputs) -> Callable[[], torch.Tensor]:
    if case.qlen == 1:
        qd = x.q.view(case.num_seqs, HKV, HQ // HKV, D)
        return lambda: F.scaled_dot_product_attention(qd, x.k, x.v, scale=D**-0.5)
    qd = x.q.view(case.num_seqs, case.qlen, HQ, D).transpose(1, 2).contiguous()
    mask = causal_lower_right(case.qlen, case.ctx)
    return lambda: F.scaled_dot_product_attention(qd, x.k, x.v, attn_mask=mask, scale=D**-0.5, enable_gqa=True)


def _paged(x: Inputs, kernels: str, tables: str) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        os.environ[ENV_VAR] = kernels
        return paged_attention(x.q, x.kv_layer, x.tables[tables], x.query_lens, x.context_lens, D**-0.5)

    return run


def _best_ms(fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: s * 1e3 for name, s in best.items()}


def run_case(case: Case, device: torch.device, repeats: int, triton_timed: bool) -> dict[str, float]:
    x = _inputs(case, device)
    kernels = ("torch", "triton") if triton_timed else ("torch",)
    fns = {"dense_sdpa": _dense(case, x)}
    for name in kernels:
        for tables in x.tables:
            fns[f"paged_{name}_{tables}"] = _paged(x, name, tables)
    reference = _rows(fns["dense_sdpa"](), case)
    for name, fn in fns.items():  # every variant must compute the same attention
        torch.testing.assert_close(_rows(fn(), case), reference, atol=1e-4, rtol=1e-4, msg=name)
    ms = _best_ms(fns, repeats, torch.cuda.synchronize if device.type == "cuda" else lambda: None)
    row = {f"{name}_ms": round(t, 3) for name, t in ms.items()}
    for name, t in ms.items():
        if name != "dense_sdpa":
            row[f"{name}_over_dense"] = round(t / ms["dense_sdpa"], 3)
    return row


def _rows(out: torch.Tensor, case: Case) -> torch.Tensor:
    """Any variant's output as [tokens, Hq, D] (dense prefill comes as [S, Hq, qlen, D])."""
    if out.dim() == 4 and case.qlen > 1:
        out = out.transpose(1, 2)
    return out.reshape(case.num_seqs * case.qlen, HQ, D)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    triton_timed = device.type == "cuda"
    previous = os.environ.get(ENV_VAR)
    results = {}
    try:
        with Progress(transient=True) as progress:
            task = progress.add_task("kernels bench", total=len(CASES))
            for case in CASES:
                results[case.name] = run_case(case, device, args.repeats, triton_timed)
                progress.advance(task)
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous
    report = {
        "bench": "kernels",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "triton_timed": triton_timed,
        "triton_note": None if triton_timed else "no CUDA device: Triton kernels were not timed",
        "shape": {"num_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "block_size": BS, "dtype": "float32"},
        "timing": f"best of {args.repeats} interleaved runs",
        "cases": results,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
