"""The shape of a model, parsed from an HF-format checkpoint dir.

`ModelConfig` is what the engine sizes its KV pool and kernels from; it is
frozen, so a loaded model's geometry cannot drift. `kv_dtype` is the dtype
the KV pool stores (config key `kv_cache_dtype`, a kvmesh extension like
vLLM's engine argument of that name; default: the compute dtype): the
real-geometry presets compute in fp32, so cache transparency is checked
without bf16 noise, and store bf16 KV, so their KV bytes are the real model's. `parse_model_config`
reads HF `config.json` (plus the eos/bos ids that generation_config.json
and tokenizer_config.json add) and fails with a `CheckpointError` naming
the field it could not use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvmesh.engine.checkpoint_error import CheckpointError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # HF rope dict with "rope_type"; None = plain RoPE
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: torch.dtype
    kv_dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers (in the KV pool's dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_dtype(name: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """Map "float32"/"bfloat16"/"float16" (or a torch dtype) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise CheckpointError(f"unsupported {field} {name!r} (supported: {', '.join(DTYPES)})")
    return DTYPES[key]


def token_ids(value: Any) -> list[int]:
    """An HF eos/bos field (None, an int or a list of ints) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(raw: dict) -> tuple[float, dict | None]:
    """rope_theta and the scaling dict, from either the HF v4 or the v5 spelling."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    if not scaling:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"config.json: unsupported rope_scaling rope_type {rope_type!r}")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    return theta, scaling


def parse_model_config(
    raw: dict,
    dtype: str | None = None,
    extra_eos_ids: list[int] | None = None,
    bos_token_id: int | None = None,
) -> ModelConfig:
    """Build a ModelConfig from a config.json dict; `dtype` overrides the file's."""
    archs = raw.get("architectures") or []
    if not archs:
        raise CheckpointError("config.json: missing field 'architectures'")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"config.json: unsupported architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        fields = dict(
            vocab_size=int(raw["vocab_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
        )
    except KeyError as exc:
        raise CheckpointError(f"config.json: missing field {exc.args[0]!r}") from None
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: unsupported hidden_act {raw['hidden_act']!r} (only silu)")
    if raw.get("use_sliding_window"):
        raise CheckpointError("config.json: use_sliding_window=true is not supported")
    theta, scaling = _rope(raw)
    dtype_name = dtype or raw.get("dtype") or raw.get("torch_dtype") or "float32"
    kv_dtype_name = raw.get("kv_cache_dtype") or dtype_name
    eos = token_ids(raw.get("eos_token_id")) + list(extra_eos_ids or [])
    bos = raw.get("bos_token_id")
    bos = bos_token_id if bos is None else bos
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias; Llama only when the config says so.
        attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        dtype=resolve_dtype(dtype_name, "config.json dtype" if dtype is None else "dtype"),
        kv_dtype=resolve_dtype(kv_dtype_name, "config.json kv_cache_dtype"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        **fields,
    )
