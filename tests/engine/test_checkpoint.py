"""Checkpoint loading: sharding, fingerprints, and a clear error for each bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvmesh.engine.checkpoint_error import CheckpointError
from kvmesh.engine.forward_batch import ForwardBatch
from kvmesh.engine.loader import load_model
from kvmesh.engine.model_config import parse_model_config
from kvmesh.engine.presets import write_preset
from safetensors.torch import load_file, save_file


def _prefill_logits(model_dir: Path) -> torch.Tensor:
    loaded = load_model(model_dir)
    cfg = loaded.config
    n = 11
    kv = torch.zeros(cfg.num_layers, 2, 4, 8, cfg.num_kv_heads, cfg.head_dim)
    batch = ForwardBatch(
        input_ids=torch.arange(5, 5 + n),
        positions=torch.arange(n),
        query_lens=torch.tensor([n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([[2, 0]], dtype=torch.int32),
        slot_mapping=torch.cat([torch.arange(16, 24), torch.arange(0, 3)]),
        logits_indices=torch.tensor([n - 1]),
    )
    return loaded.model(batch, kv)


@pytest.fixture
def broken(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint to damage."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "ckpt"))


def _edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _rewrite_weights(model_dir: Path, edit) -> None:  # noqa: ANN001
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_sharded_checkpoint_loads_identically(tiny_model_dir: Path, tmp_path: Path) -> None:
    sharded = write_preset(tmp_path / "sharded", "tiny", "llama", seed=0, num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    assert not (sharded / "model.safetensors").exists()
    assert torch.equal(_prefill_logits(sharded), _prefill_logits(tiny_model_dir))
    assert load_model(sharded).fingerprint == load_model(tiny_model_dir).fingerprint


def test_fingerprint_and_preset_bytes_are_stable_across_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    code = (
        "import sys; from kvmesh.engine.loader import load_model; from kvmesh.engine.presets import write_preset; "
        "write_preset(sys.argv[2], 'tiny', 'llama', seed=0); print(load_model(sys.argv[1]).fingerprint)"
    )
    again = tmp_path / "again"
    out = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model_dir), str(again)], capture_output=True, text=True, check=True
    )
    fp = load_model(tiny_model_dir).fingerprint
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert out.stdout.strip() == fp
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_other_seed_other_fingerprint(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = write_preset(tmp_path / "other", "tiny", "llama", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert load_model(other).fingerprint != load_model(tiny_model_dir).fingerprint


def test_config_change_changes_fingerprint(broken: Path, tiny_model_dir: Path) -> None:
    _edit_config(broken, rms_norm_eps=1e-4)
    assert load_model(broken).fingerprint != load_model(tiny_model_dir).fingerprint


def test_missing_config(broken: Path) -> None:
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_model(broken)


def test_unknown_architecture_is_named(broken: Path) -> None:
    _edit_config(broken, architectures=["MixtralForCausalLM"])
    with pytest.raises(CheckpointError, match="unsupported architecture 'MixtralForCausalLM'"):
        load_model(broken)


def test_missing_config_field_is_named(broken: Path) -> None:
    config = json.loads((broken / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing field 'hidden_size'"):
        load_model(broken)


def test_missing_tokenizer(broken: Path) -> None:
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing"):
        load_model(broken)


def test_truncated_safetensors_names_file(broken: Path) -> None:
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_model(broken)


def test_garbage_safetensors_names_file(broken: Path) -> None:
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_model(broken)


def test_missing_tensor_is_named(broken: Path) -> None:
    _rewrite_weights(broken, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(broken)


def test_shape_mismatch_is_named(broken: Path) -> None:
    def shrink(tensors: dict) -> None:
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    _rewrite_weights(broken, shrink)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[8, 64\]"):
        load_model(broken)


def test_unexpected_tensor_is_named(broken: Path) -> None:
    def add(tensors: dict) -> None:
        tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(176)

    _rewrite_weights(broken, add)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.gate_proj\.bias'"):
        load_model(broken)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    sharded = write_preset(tmp_path / "sharded", "tiny", "llama", seed=0, num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: missing"):
        load_model(sharded)


def test_dtype_override_and_bad_dtype(tiny_model_dir: Path) -> None:
    assert load_model(tiny_model_dir, dtype="bfloat16").config.dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match="unsupported dtype 'int8'"):
        load_model(tiny_model_dir, dtype="int8")


def test_config_fields_and_eos(tiny_model_dir: Path, tiny_qwen2_model_dir: Path) -> None:
    llama, qwen = load_model(tiny_model_dir), load_model(tiny_qwen2_model_dir)
    tok = llama.tokenizer
    assert llama.config.eos_token_ids == (tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>"))
    assert llama.config.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert llama.config.rope_scaling is not None and llama.config.rope_scaling["rope_type"] == "llama3"
    assert not llama.config.tie_word_embeddings and not llama.config.attention_bias
    assert qwen.config.tie_word_embeddings and qwen.config.attention_bias
    assert qwen.model.lm_head is None
    assert llama.config.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4


def test_rope_config_spellings(tiny_model_dir: Path) -> None:
    v4 = json.loads((tiny_model_dir / "config.json").read_text())
    v5 = {k: v for k, v in v4.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**v4["rope_scaling"], "rope_theta": v4["rope_theta"]}
    assert parse_model_config(v5) == parse_model_config(v4)
    plain = {**v5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert parse_model_config(plain).rope_scaling is None and parse_model_config(plain).rope_theta == 1e4
    with pytest.raises(CheckpointError, match="unsupported rope_scaling rope_type 'yarn'"):
        parse_model_config({**v4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
