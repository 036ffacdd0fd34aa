"""Seeded synthetic checkpoints in HF format: `tiny` for tests, `agent` (tiny's
widths, 32k positions: what `kvmesh up` serves, so agent trajectories replay
to their last turn), `small` for benches, `llama3-8b` / `llama3-70b` for the KV
data path at real geometry.

The geometry presets carry the real models' KV shape (layers, KV heads,
head dim, bf16 KV: 131,072 bytes per token for Llama-3-8B, 327,680 for
Llama-3-70B) and 32k positions, but a small hidden and MLP size, so they
run on a CPU: what they exercise is every byte the cache moves, not the
model's quality. They compute in the `dtype` asked for (fp32 by default)
and store KV as bf16 (`kv_cache_dtype`).

`write_preset` writes config.json, model.safetensors (or shards + index),
tokenizer.json (a byte-level BPE trained at init), tokenizer_config.json
with a Llama-3 style chat template, and generation_config.json. Same
arguments -> byte-identical files -> same fingerprint.

Init is chosen for cache transparency (DESIGN.md): the lm_head is scaled so
logits have a std of ~`LOGIT_STD` and the top-2 gap is typically far above
float-ordering noise; q/k are scaled so attention is peaked, not uniform,
and residual branches outweigh the embedding, so the next token depends on
the whole context (position and cache bugs show in logits) rather than
echoing the last token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from kvmesh.engine.checkpoint_writer import save_weights, write_json
from kvmesh.engine.model import PagedCausalLM
from kvmesh.engine.model_config import ModelConfig, parse_model_config, resolve_dtype
from kvmesh.engine.synthetic_tokenizer import (
    BOS,
    EOS,
    EOT,
    LLAMA3_CHAT_TEMPLATE,
    train_tokenizer,
)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
LOGIT_STD = 4.0


@dataclass(frozen=True, slots=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # tokenizer training target; config takes the trained size
    max_position_embeddings: int
    kv_cache_dtype: str | None = None  # None: KV in the compute dtype


PRESETS = {
    "tiny": Preset(64, 176, 2, 4, 2, 16, 1024, 4096),
    # As cheap to run as tiny (512 B of KV per token), long enough for an agent's whole context.
    "agent": Preset(64, 176, 2, 4, 2, 16, 1024, 32768),
    "small": Preset(768, 2048, 6, 12, 4, 64, 8192, 16384),
    # Real KV geometry (32 x 8 x 128 and 80 x 8 x 128, bf16); hidden/MLP cut to CPU size.
    "llama3-8b": Preset(256, 512, 32, 8, 8, 128, 1024, 32768, "bfloat16"),
    "llama3-70b": Preset(256, 512, 80, 8, 8, 128, 1024, 32768, "bfloat16"),
}


def preset_config(preset: Preset, arch: str, dtype: str, vocab_size: int) -> dict:
    """The config.json dict. Llama gets Llama-3.1 rope scaling; Qwen2 ties embeddings."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r} (choose from {', '.join(ARCHITECTURES)})")
    llama = arch == "llama"
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-5 if llama else 1e-6,
        "rope_theta": 500000.0 if llama else 1000000.0,
        "tie_word_embeddings": not llama,
        "torch_dtype": dtype,
    }
    if preset.kv_cache_dtype is not None:
        config["kv_cache_dtype"] = preset.kv_cache_dtype
    if llama:
        config["attention_bias"] = False
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(preset.max_position_embeddings // 4, 256),
        }
    return config


def _init_std(name: str, shape: torch.Size, cfg: ModelConfig) -> float:
    fan_in = shape[-1]
    if name == "lm_head.weight" or (name.endswith("embed_tokens.weight") and cfg.tie_word_embeddings):
        return LOGIT_STD / math.sqrt(cfg.hidden_size)
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        # Residual branches outweigh the embedding, so with tied embeddings the
        # final state is not just the input token again (which would echo it).
        return 2.0 / math.sqrt(fan_in)
    if name.endswith("bias"):
        return 0.1
    return 1.0 / math.sqrt(fan_in)


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights for every parameter of the model, drawn in name order in fp32."""
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in PagedCausalLM(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * noise  # not all-ones, so swapped norms would show
        else:
            value = noise * _init_std(name, shapes[name], cfg)
        tensors[name] = value.to(cfg.dtype)
    return tensors


def write_preset(
    out_dir: Path,
    preset: str = "tiny",
    arch: str = "llama",
    dtype: str = "float32",
    seed: int = 0,
    num_shards: int = 1,
    overrides: dict | None = None,
) -> Path:
    """Write a complete checkpoint dir; `overrides` patch config.json (e.g. tied embeddings)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    resolve_dtype(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(PRESETS[preset].vocab_size)
    config = preset_config(PRESETS[preset], arch, dtype, tokenizer.get_vocab_size())
    config["bos_token_id"] = tokenizer.token_to_id(BOS)
    config["eos_token_id"] = [tokenizer.token_to_id(EOS), tokenizer.token_to_id(EOT)]
    config.update(overrides or {})
    cfg = parse_model_config(config)
    save_weights(out_dir, random_weights(cfg, seed), num_shards)
    write_json(out_dir / "config.json", config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOT,
            "pad_token": EOS,
            "model_max_length": cfg.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            "chat_template": LLAMA3_CHAT_TEMPLATE,
        },
    )
    write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False},
    )
    return out_dir
