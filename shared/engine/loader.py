"""`load_model`: an HF-format checkpoint dir -> a ready `PagedCausalLM`.

Reads config.json, generation_config.json and tokenizer_config.json
(eos_token_ids is the union of their eos ids, in that order), the
tokenizer, and the safetensors weights (checked against the model's
parameter names and shapes). The fingerprint is
sha256(canonical config JSON + effective dtype + weight digest): equal for
the same dir in any process, different for any other weights or dtype,
which is what block hashes key on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from kvmesh.engine.checkpoint import read_json, read_weights
from kvmesh.engine.model import PagedCausalLM
from kvmesh.engine.model_config import ModelConfig, parse_model_config, token_ids
from kvmesh.engine.tokenizer import Tokenizer

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: torch.nn.Module
    tokenizer: Tokenizer
    fingerprint: str
    path: Path


def fingerprint(raw_config: dict, dtype_name: str, weight_digest: str) -> str:
    canonical = json.dumps(
        {"config": raw_config, "dtype": dtype_name}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode() + b"\0" + weight_digest.encode()).hexdigest()


def load_model(model_dir: Path, dtype: str | None = None, device: str = "cpu") -> LoadedModel:
    """Load a checkpoint dir; `dtype` ("float32"/"bfloat16") overrides config.json's."""
    model_dir = Path(model_dir)
    raw = read_json(model_dir / CONFIG_FILE)
    generation = read_json(model_dir / GENERATION_CONFIG_FILE, required=False)
    tokenizer = Tokenizer.from_dir(model_dir)
    bos = generation.get("bos_token_id")
    bos = tokenizer.bos_token_id if bos is None else bos
    cfg = parse_model_config(
        raw,
        dtype=dtype,
        extra_eos_ids=token_ids(generation.get("eos_token_id")) + list(tokenizer.eos_token_ids),
        bos_token_id=bos,
    )
    # Build on meta (no throwaway init), then adopt the checkpoint tensors.
    with torch.device("meta"):
        model = PagedCausalLM(cfg, device=device)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    ignore = frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset()
    weights = read_weights(model_dir, expected, cfg.dtype, ignore)
    tensors = {name: t.to(device) for name, t in weights.tensors.items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    model.eval().requires_grad_(False)
    return LoadedModel(
        config=cfg,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint(raw, cfg.dtype_name, weights.digest),
        path=model_dir,
    )
