"""Modeled time to first token of a replayed request: recompute what missed, restore what L2 held.

    recompute(a -> b) = (prefill_flops(b) - prefill_flops(a)) / (peak x MFU)   (shared/sim/recompute_model.py)
    restore(n tokens from L2) = n x kv_bytes_per_token / l2_gbps

L1 hits cost nothing (the KV is already on the device). The L2 part of the
prefix is restored if that is faster than recomputing it, else recomputed;
the rest of the prompt is always recomputed. Decode of the first token and
queueing are left out: they are the same under every policy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvmesh.sim.recompute_model import (
    DEFAULT_MFU,
    GEOMETRIES,
    H200_PEAK_BF16_FLOPS,
    Geometry,
    prefill_flops,
)

# Host DRAM -> H200 over PCIe 5.0 x16 (64 GB/s per direction): about half of it for paged, scattered KV.
DEFAULT_L2_GBPS = 25.0


@dataclass(frozen=True, slots=True)
class TTFTModel:
    geometry: str = "8b"
    mfu: float = DEFAULT_MFU
    l2_gbps: float = DEFAULT_L2_GBPS

    @property
    def geo(self) -> Geometry:
        return GEOMETRIES[self.geometry]

    def seconds(self, l1_tokens: int, l2_tokens: int, total_tokens: int) -> float:
        """TTFT of a prompt of ``total_tokens`` whose first ``l1_tokens`` hit L1 and next ``l2_tokens`` L2."""
        rate = H200_PEAK_BF16_FLOPS * self.mfu
        cached = l1_tokens + l2_tokens
        rest = (prefill_flops(self.geo, total_tokens) - prefill_flops(self.geo, cached)) / rate
        recompute_l2 = (prefill_flops(self.geo, cached) - prefill_flops(self.geo, l1_tokens)) / rate
        restore_l2 = l2_tokens * self.geo.kv_bytes_per_token / (self.l2_gbps * 1e9)
        return rest + min(recompute_l2, restore_l2)

    def describe(self) -> dict:
        return {
            "gpu": "H200",
            "recompute": "(prefill_flops(b) - prefill_flops(a)) / (peak * mfu); "
                         "prefill_flops(n) = 2*params*n + 4*layers*q_heads*head_dim*n^2/2",
            "peak_bf16_tflops": H200_PEAK_BF16_FLOPS / 1e12,
            "mfu": self.mfu,
            "geometry": asdict(self.geo),
            "kv_bytes_per_token": self.geo.kv_bytes_per_token,
            "l1_restore": "free (already on the device)",
            "l2_restore_gbps": self.l2_gbps,
            "l2_rule": "restore the L2 part if faster than recomputing it",
        }
