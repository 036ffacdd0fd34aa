"""What recomputing a prefix costs on the GPU users run: the comparator of every KV restore.

A restore pays only if it is faster than prefilling the same tokens again.
CPU recompute is no comparator (about a thousand times slower than the
GPUs kvmesh serves on), so the time is modeled, and the model is printed
with every result:

    prefill FLOPs for n tokens from position 0
        = 2 x params x n                          (every weight: one multiply-add per token)
        + 4 x layers x q_heads x head_dim x n^2/2 (QK^T and PV, causal: token i sees i keys)
    seconds = FLOPs / (peak x MFU)

The geometries are the real models' (not the CPU-sized presets that carry
their KV shape): Llama-3-8B and Llama-3-70B, bf16.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

H200_PEAK_BF16_FLOPS = 989e12  # dense bf16, SXM
DEFAULT_MFU = 0.5


@dataclass(frozen=True, slots=True)
class Geometry:
    preset: str  # the CPU-sized checkpoint with this KV shape (shared/engine/presets.py)
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_itemsize: int = 2  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_itemsize


GEOMETRIES = {
    "8b": Geometry("llama3-8b", params=8.03e9, layers=32, q_heads=32, kv_heads=8, head_dim=128),
    "70b": Geometry("llama3-70b", params=70.6e9, layers=80, q_heads=64, kv_heads=8, head_dim=128),
}


def prefill_flops(g: Geometry, tokens: int) -> float:
    return 2 * g.params * tokens + 4 * g.layers * g.q_heads * g.head_dim * tokens * tokens / 2


def recompute_s(g: Geometry, tokens: int, mfu: float = DEFAULT_MFU, peak: float = H200_PEAK_BF16_FLOPS) -> float:
    return prefill_flops(g, tokens) / (peak * mfu)


def describe(g: Geometry, tokens: int, mfu: float = DEFAULT_MFU, peak: float = H200_PEAK_BF16_FLOPS) -> dict:
    """The model as printed next to the results: formula, inputs, and the break-even restore rate."""
    seconds = recompute_s(g, tokens, mfu, peak)
    return {
        "gpu": "H200",
        "formula": "2*params*n + 4*layers*q_heads*head_dim*n^2/2 FLOPs; s = FLOPs / (peak * mfu)",
        "peak_bf16_tflops": peak / 1e12,
        "mfu": mfu,
        "geometry": asdict(g),
        "tokens": tokens,
        "recompute_s": round(seconds, 4),
        "break_even_gbps": round(g.kv_bytes_per_token * tokens / seconds / 1e9, 3),
    }
