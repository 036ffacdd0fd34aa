"""`kvmesh model init --gguf`: GGUF files written here from the tiny presets, the way llama.cpp's converter
writes them (HF names to GGUF names, Llama's q/k rows permuted, tensors quantized), imported back."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from kvmesh.cli.main import app
from kvmesh.config import EngineSettings
from kvmesh.engine.checkpoint_error import CheckpointError
from kvmesh.engine.engine import Engine
from kvmesh.engine.gguf_import import (
    IMPORT_FILE,
    TENSOR_TYPES,
    hf_name,
    import_gguf,
    sha256_file,
)
from kvmesh.engine.loader import load_model
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.tokenizer import Tokenizer
from safetensors.torch import load_file
from typer.testing import CliRunner

Q = gguf.GGMLQuantizationType
TEXTS = ("the agent calls the tool and reads the result.", "<|begin_of_text|>hello world<|eot_id|>", "cache  block\n\ttoken!")


def _gguf_names(config: dict) -> dict[str, str]:
    """HF name -> GGUF name for every tensor of a checkpoint with `config` (the inverse of `hf_name`)."""
    names = ["token_embd.weight", "output_norm.weight"] + ([] if config["tie_word_embeddings"] else ["output.weight"])
    inner = ["attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
             "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    if config["model_type"] == "qwen2":
        inner += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    names += [f"blk.{i}.{n}" for i in range(config["num_hidden_layers"]) for n in inner]
    return {hf_name(n): n for n in names}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Llama q/k: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, path: Path, qtype: Q = Q.F32, arch: str | None = None, pre: str = "gpt2",
               extra_tensor: tuple[str, np.ndarray, Q] | None = None) -> dict[str, np.ndarray]:
    """A GGUF file of checkpoint `model_dir`; returns the float32 arrays the import must give back (HF names)."""
    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    arch = arch or config["model_type"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"][-1])
    w.add_chat_template(json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"])
    expected = {}
    heads = {"attn_q.weight": config["num_attention_heads"], "attn_k.weight": config["num_key_value_heads"]}
    for name, tensor in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        gname = _gguf_names(config)[name]
        rotary = heads.get(gname.split(".", 2)[-1]) if arch == "llama" else None
        array = tensor.float().numpy()
        stored = np.ascontiguousarray(_permute(array, rotary) if rotary else array)
        kind = qtype if array.ndim == 2 and array.shape[-1] % 32 == 0 else Q.F32  # blocks run along rows
        packed = stored if kind == Q.F32 else gguf.quants.quantize(stored, kind)
        w.add_tensor(gname, packed, raw_dtype=None if kind == Q.F32 else kind)  # shape: from the packed bytes
        back = gguf.quants.dequantize(packed, kind).reshape(stored.shape)
        expected[name] = _unpermute(back, rotary) if rotary else back
    if extra_tensor is not None:
        name, array, kind = extra_tensor
        w.add_tensor(name, array, raw_dtype=None if kind == Q.F32 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(load_model(model_dir), EngineSettings(block_size=8, num_blocks=64))
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=12, detokenize=False))]


@pytest.mark.parametrize("preset", ["tiny_model_dir", "tiny_qwen2_model_dir"])
def test_an_f32_file_imports_to_the_very_checkpoint_it_came_from(preset: str, request, tmp_path: Path) -> None:
    source: Path = request.getfixturevalue(preset)
    write_gguf(source, tmp_path / "m.gguf")
    summary = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    got, want = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    if config["tie_word_embeddings"]:
        want.pop("lm_head.weight", None)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n].float()) for n in want)
    imported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert imported["tie_word_embeddings"] == config["tie_word_embeddings"]
    assert imported["architectures"] == config["architectures"] and "quantization_config" not in imported
    assert json.loads((tmp_path / "out" / IMPORT_FILE).read_text())["source_sha256"] == sha256_file(tmp_path / "m.gguf")
    assert summary.tensor_types == {"F32": len(want)}
    ours, theirs = Tokenizer.from_dir(tmp_path / "out"), Tokenizer.from_dir(source)
    assert all(ours.encode(t) == theirs.encode(t) for t in TEXTS)
    prompts = [theirs.encode(t) for t in TEXTS]
    assert _greedy(tmp_path / "out", prompts) == _greedy(source, prompts)  # same model, token for token


@pytest.mark.parametrize("qtype", sorted(TENSOR_TYPES - {"F32"}))
def test_each_quantized_type_imports_to_what_gguf_dequantizes(qtype: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    expected = write_gguf(tiny_model_dir, tmp_path / "m.gguf", Q[qtype])
    summary = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert summary.tensor_types.get(qtype, 0) > 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, array in expected.items():
        assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(array))), name
    load_model(tmp_path / "out")  # and the engine loads it


def _refused(path: Path, out: Path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        import_gguf(path, out)
    assert not out.exists()


def test_what_it_cannot_import_is_refused_by_name_and_nothing_is_written(tiny_model_dir: Path, tmp_path: Path) -> None:
    write_gguf(tiny_model_dir, tmp_path / "arch.gguf", arch="mamba")
    _refused(tmp_path / "arch.gguf", tmp_path / "o1", "architecture 'mamba' is not supported")
    write_gguf(tiny_model_dir, tmp_path / "pre.gguf", pre="klingon")
    _refused(tmp_path / "pre.gguf", tmp_path / "o2", "pre-tokenizer 'klingon' is not supported")
    k_quant = np.zeros((4, gguf.GGML_QUANT_SIZES[Q.Q4_K][1]), dtype=np.uint8)  # 4 rows of one 256-value block
    write_gguf(tiny_model_dir, tmp_path / "k.gguf", extra_tensor=("blk.0.extra.weight", k_quant, Q.Q4_K))
    _refused(tmp_path / "k.gguf", tmp_path / "o3", "tensor types Q4_K are not supported")
    write_gguf(tiny_model_dir, tmp_path / "name.gguf",
               extra_tensor=("blk.0.attn_sinks.weight", np.ones(4, dtype=np.float32), Q.F32))
    _refused(tmp_path / "name.gguf", tmp_path / "o4", "tensor 'blk.0.attn_sinks.weight' is not supported")
    (tmp_path / "text.gguf").write_text("not a model")
    _refused(tmp_path / "text.gguf", tmp_path / "o5", "not a readable GGUF file")


def test_the_cli_imports_or_says_why_not(tiny_model_dir: Path, tmp_path: Path) -> None:
    write_gguf(tiny_model_dir, tmp_path / "m.gguf", Q.Q8_0)
    ok = CliRunner().invoke(app, ["model", "init", "--gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out")])
    assert ok.exit_code == 0, ok.output
    summary = json.loads(ok.output)
    assert summary["architecture"] == "LlamaForCausalLM" and summary["num_layers"] == 2
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 8)
    bad = CliRunner().invoke(app, ["model", "init", "--gguf", str(tmp_path / "bad.gguf"), "--out", str(tmp_path / "o")])
    assert bad.exit_code == 1 and "error:" in bad.output
