"""The paged decoder-only transformer (Llama / Qwen2 family).

Parameter names equal HF's (`model.layers.0.self_attn.q_proj.weight` ...), so
an HF state dict loads as is. One forward runs a whole varlen `ForwardBatch`:
each layer writes the new tokens' K/V into its slice of the paged cache
(kernels.kv_write) and attends over the cache (kernels.paged_attention), so
prefill, prefill over a cached prefix and decode are one path. Only the
rows at `logits_indices` reach the final norm and lm_head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvmesh.engine.forward_batch import ForwardBatch
from kvmesh.engine.model_config import ModelConfig
from kvmesh.engine.rope_tables import rope_tables
from kvmesh.kernels.kv_write import write_kv
from kvmesh.kernels.paged_attention import paged_attention
from kvmesh.kernels.rope import apply_rope
from torch import nn

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) tables of rope_tables(), indexed by position


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalize in float32, scale in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too.
        o_bias = bias and cfg.architecture == "LlamaForCausalLM"
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_layer: torch.Tensor, rope: Rope) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, k, batch.positions, *rope)
        write_kv(kv_layer, k, v, batch.slot_mapping)
        o = paged_attention(
            q, kv_layer, batch.block_tables, batch.query_lens, batch.context_lens, self.scale
        )
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_layer: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv_layer, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class PagedCausalLM(nn.Module):
    """`model(batch, kv_cache) -> logits [S, vocab] float32` at batch.logits_indices.

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    in the model's dtype (see shared/engine/forward_batch.py). The rope tables
    are built on `device` even when the module itself is built on meta.
    """

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        cos, sin = rope_tables(cfg, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids)
        rope = (self.rope_cos, self.rope_sin)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, batch, kv_cache[i], rope)
        # The norm is per row, so selecting first gives the same numbers for less work.
        h = self.model.norm(h[batch.logits_indices])
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, head).float()
