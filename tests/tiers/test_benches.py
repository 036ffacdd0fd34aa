"""The tier benches run end to end at toy sizes (numbers are not asserted: that is the bench's job)."""

from __future__ import annotations

from kvmesh.bench.peer_fetch import run as run_peer_fetch
from kvmesh.bench.tiers import TierBenchConfig, run_tiers_bench
from rich.console import Console
from rich.progress import Progress


def test_tiers_bench_smoke() -> None:
    result = run_tiers_bench(TierBenchConfig(blocks=24, chunk_tokens=128, restore=False))
    assert result["l3"]["objects"] == 3 and set(result["ratios"]) == {"l2_load_vs_memcpy", "l3_load_vs_raw_s3"}
    assert all(v > 0 for v in result["ratios"].values())


async def test_peer_fetch_bench_smoke() -> None:
    with Progress(console=Console(stderr=True), transient=True) as progress:
        result = await run_peer_fetch(20, 4, progress)
    assert result["blocks"] == 20 and result["http_vs_nats"] > 0 and result["shm_vs_http"] > 0
