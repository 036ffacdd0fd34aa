"""The real-geometry presets: the KV shape and bytes of Llama-3-8B/70B, bf16 KV, fp32 compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import load_model
from kvmesh.engine.model_config import parse_model_config
from kvmesh.engine.presets import PRESETS, preset_config
from kvmesh.engine.sampling import SamplingParams

REAL_KV_BYTES_PER_TOKEN = {"llama3-8b": 32 * 8 * 128 * 2 * 2, "llama3-70b": 80 * 8 * 128 * 2 * 2}


@pytest.mark.parametrize("name", sorted(REAL_KV_BYTES_PER_TOKEN))
def test_kv_geometry_is_the_real_models(name: str) -> None:
    cfg = parse_model_config(preset_config(PRESETS[name], "llama", "float32", 1024))
    assert cfg.kv_bytes_per_token() == REAL_KV_BYTES_PER_TOKEN[name]  # 131,072 and 327,680
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_dtype) == (8, 128, torch.bfloat16)
    assert cfg.dtype == torch.float32 and cfg.max_position_embeddings >= 32768


def test_a_config_without_kv_cache_dtype_keeps_kv_in_the_compute_dtype() -> None:
    cfg = parse_model_config(preset_config(PRESETS["tiny"], "llama", "bfloat16", 1024))
    assert cfg.kv_dtype == cfg.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def engine_8b(llama3_8b_model_dir: Path):
    loaded = load_model(llama3_8b_model_dir)
    return loaded, lambda **kw: Engine(loaded, EngineSettings(num_blocks=64, max_num_batched_tokens=256, **kw))


def test_8b_pool_holds_bf16_blocks_of_the_real_size(engine_8b) -> None:
    loaded, make = engine_8b
    engine = make()
    assert engine.kv_cache.dtype == torch.bfloat16
    prompt = list(range(3, 3 + 2 * engine.block_size + 1))
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    blocks = engine.export_blocks(engine.block_hashes(prompt))
    assert len(blocks) == 2
    assert blocks[0].data.dtype == torch.bfloat16
    assert blocks[0].data.numel() * blocks[0].data.element_size() == 131072 * engine.block_size


def test_8b_prefix_hit_gives_the_same_tokens_as_a_cold_run(engine_8b) -> None:
    """Cache transparency with bf16 KV: the cached prefix was rounded exactly as a cold run rounds it."""
    loaded, make = engine_8b
    prompt = torch.randint(0, loaded.config.vocab_size - 8, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    warm = make()
    first = warm.generate([prompt], params)[0].token_ids
    follow_up = prompt + first + [5, 6, 7]
    hit = warm.generate([follow_up], params)[0]
    cold = make(enable_prefix_caching=False).generate([follow_up], params)[0]
    assert hit.cached_tokens >= len(prompt) // warm.block_size * warm.block_size
    assert hit.token_ids == cold.token_ids
