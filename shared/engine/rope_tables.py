"""cos/sin tables for rotary embeddings, computed once per model at load.

Tables are ``[max_positions, head_dim // 2]`` float32 (kernels.rope.apply_rope
repeats them over both halves). Frequencies follow HF exactly, including
Llama-3 (`rope_type: llama3`) and linear scaling, so positions rotate
identically to transformers in fp32.
"""

from __future__ import annotations

import math

import torch
from kvmesh.engine.model_config import ModelConfig


def inv_frequencies(cfg: ModelConfig, device: str | torch.device = "cpu") -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2], after any rope scaling."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float) / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    cfg: ModelConfig, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_position_embeddings, head_dim // 2] float32."""
    inv_freq = inv_frequencies(cfg, device)
    positions = torch.arange(cfg.max_position_embeddings, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()
