"""Import a GGUF file (llama.cpp's format) as the HF-format checkpoint dir the engine loads.

`import_gguf(src, out_dir)` reads the file with the `gguf` library and writes:
- `model.safetensors`: every tensor dequantized (F32, F16, BF16, Q8_0, Q4_0,
  Q4_1, Q5_0, Q5_1) and renamed to the HF Llama/Qwen2 names; llama.cpp's
  converter interleaves the rotary halves of Llama's q/k rows, which is
  undone here (Qwen2 files are not permuted);
- `config.json` from the `<arch>.*` metadata (no `quantization_config`: the
  weights are plain floats now, which vLLM also accepts);
- `tokenizer.json` (shared/engine/gguf_tokenizer.py), `tokenizer_config.json`
  with the file's chat template and bos/eos tokens, `generation_config.json`;
- `gguf_import.json`: the source's name, size and SHA-256, so an import can be
  checked against the file it came from.

Anything else (another architecture, K-quants, rope scaling) is refused with
a `CheckpointError` that names it, before anything is written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from kvmesh.engine.checkpoint_error import CheckpointError
from kvmesh.engine.checkpoint_writer import save_weights, write_json
from kvmesh.engine.gguf_tokenizer import GGUFVocab, build_tokenizer
from kvmesh.engine.model_config import resolve_dtype

IMPORT_FILE = "gguf_import.json"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
TENSOR_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"})

_LAYER_TENSORS = {  # GGUF name inside blk.N -> HF name inside model.layers.N
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


@dataclass(frozen=True, slots=True)
class ImportSummary:
    out_dir: Path
    architecture: str
    source_sha256: str
    tensor_types: dict[str, int]  # GGUF tensor type -> how many tensors had it


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def hf_name(gguf_name: str) -> str:
    """The HF tensor name of a GGUF one; CheckpointError for a tensor this import does not know."""
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, inner = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and inner in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[inner]}"
    if gguf_name == "rope_freqs.weight":
        raise CheckpointError("GGUF tensor rope_freqs.weight (per-frequency rope scaling) is not supported")
    raise CheckpointError(f"GGUF tensor {gguf_name!r} is not supported")


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head it stores rotary pairs interleaved, HF stores the halves."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class _File:
    """One GGUF file's metadata and tensors, read through the `gguf` library."""

    def __init__(self, path: Path) -> None:
        import gguf  # only the import pays for it

        try:
            self._reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError) as exc:  # a bad magic or a truncated file
            raise CheckpointError(f"{path.name}: not a readable GGUF file ({exc})") from None
        self._dequantize = gguf.quants.dequantize
        self.arch = str(self.get("general.architecture"))

    def get(self, key: str, default: object = None) -> object:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default: object = None) -> object:
        value = self.get(f"{self.arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata {self.arch}.{key} is missing")
        return value

    def names(self) -> set[str]:
        return {t.name for t in self._reader.tensors}

    def tensor_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self._reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(GGUF name, float32 array in HF layout: rows first)."""
        for t in self._reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            yield t.name, np.asarray(self._dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)

    def vocab(self) -> GGUFVocab:
        return GGUFVocab(model=str(self.get("tokenizer.ggml.model", "")), pre=str(self.get("tokenizer.ggml.pre", "default")),
                         tokens=list(self.get("tokenizer.ggml.tokens", [])),
                         token_types=[int(k) for k in self.get("tokenizer.ggml.token_type", [])],
                         merges=list(self.get("tokenizer.ggml.merges", [])))


def _check_supported(f: _File) -> None:
    if f.arch not in ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture {f.arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    unsupported = sorted(set(f.tensor_types()) - TENSOR_TYPES)
    if unsupported:
        raise CheckpointError(f"GGUF tensor types {', '.join(unsupported)} are not supported "
                              f"(supported: {', '.join(sorted(TENSOR_TYPES))})")
    scaling = f.get(f"{f.arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"GGUF rope scaling {scaling!r} is not supported")


def _config(f: _File, vocab_size: int, tied: bool, dtype: str) -> dict:
    hidden, heads = int(f.arch_value("embedding_length")), int(f.arch_value("attention.head_count"))
    head_dim = int(f.get(f"{f.arch}.attention.key_length") or f.get(f"{f.arch}.rope.dimension_count") or hidden // heads)
    config = {
        "architectures": [ARCHITECTURES[f.arch]],
        "model_type": f.arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(f.arch_value("feed_forward_length")),
        "num_hidden_layers": int(f.arch_value("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.arch_value("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(f.arch_value("context_length")),
        "rms_norm_eps": float(f.arch_value("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(f.arch_value("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
    }
    if f.arch == "llama":
        config["attention_bias"] = False
    return config


def _special_ids(f: _File) -> tuple[int | None, list[int]]:
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos = [int(i) for i in (f.get("tokenizer.ggml.eos_token_id"), f.get("tokenizer.ggml.eot_token_id")) if i is not None]
    return (None if bos is None else int(bos)), list(dict.fromkeys(eos))


def _weights(f: _File, config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    heads = {"attn_q.weight": config["num_attention_heads"], "attn_k.weight": config["num_key_value_heads"]}
    out: dict[str, torch.Tensor] = {}
    for name, array in f.tensors():
        inner = name.partition(".")[2].partition(".")[2]
        if f.arch == "llama" and name.startswith("blk.") and inner in heads:
            array = unpermute_rotary(array, heads[inner])
        out[hf_name(name)] = torch.from_numpy(np.array(array, dtype=np.float32)).to(dtype)  # owned, writable
    return out


def import_gguf(src: Path, out_dir: Path, dtype: str = "float32") -> ImportSummary:
    """Write the checkpoint dir for GGUF file `src` into `out_dir` (created); see the module docstring."""
    src, out_dir = Path(src), Path(out_dir)
    torch_dtype = resolve_dtype(dtype)
    if not src.is_file():
        raise CheckpointError(f"{src}: no such GGUF file")
    f = _File(src)
    _check_supported(f)
    vocab = f.vocab()
    tokenizer = build_tokenizer(vocab)
    bos_id, eos_ids = _special_ids(f)
    config = _config(f, len(vocab.tokens), "output.weight" not in f.names(), dtype)
    config["bos_token_id"], config["eos_token_id"] = bos_id, eos_ids
    tensors = _weights(f, config, torch_dtype)  # every name is checked here, before anything is written
    embed = tensors["model.embed_tokens.weight"]
    if embed.shape[0] != len(vocab.tokens):
        raise CheckpointError(f"GGUF token_embd has {embed.shape[0]} rows for {len(vocab.tokens)} tokens")
    digest = sha256_file(src)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_weights(out_dir, tensors)
    write_json(out_dir / "config.json", config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None if bos_id is None else vocab.tokens[bos_id],
        "eos_token": vocab.tokens[eos_ids[0]] if eos_ids else None,
        "model_max_length": config["max_position_embeddings"],
        "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    template = f.get("tokenizer.chat_template")
    if template is not None:
        tok_config["chat_template"] = str(template)
    write_json(out_dir / "tokenizer_config.json", tok_config)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": bos_id, "eos_token_id": eos_ids, "do_sample": False})
    write_json(out_dir / IMPORT_FILE, {"source": src.name, "source_bytes": src.stat().st_size,
                                       "source_sha256": digest, "dtype": dtype})
    return ImportSummary(out_dir, ARCHITECTURES[f.arch], digest, f.tensor_types())
