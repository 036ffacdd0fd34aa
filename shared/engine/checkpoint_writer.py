"""Writing weights and JSON in HF checkpoint format (used by the presets).

Output is byte-deterministic: tensors are saved in name order, JSON with
sorted keys, so the same inputs give the same files and fingerprint.
With `num_shards > 1` the weights are split by name order into
`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from kvmesh.engine.checkpoint import INDEX_FILE, SINGLE_FILE
from safetensors.torch import save_file


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def save_weights(out_dir: Path, tensors: dict[str, torch.Tensor], num_shards: int = 1) -> list[Path]:
    """Save tensors as one file or `num_shards` shards with an index; return the files."""
    names = sorted(tensors)
    if num_shards <= 1:
        path = out_dir / SINGLE_FILE
        save_file({n: tensors[n].contiguous() for n in names}, str(path), metadata={"format": "pt"})
        return [path]
    per_shard = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    files = []
    for i in range(num_shards):
        chunk = names[i * per_shard : (i + 1) * per_shard]
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in chunk}, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
        files.append(out_dir / fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files
