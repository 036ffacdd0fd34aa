"""Reading an HF-format checkpoint dir: JSON files and safetensors weights.

`read_json` names the file on any failure. `read_weights` opens
`model.safetensors` or the shards listed in `model.safetensors.index.json`,
checks every tensor against the names/shapes the model expects, and hashes
names, shapes, dtypes and bytes while the tensors are read, so the weight
digest costs no second pass over the files. The digest is independent of
how the weights are sharded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from kvmesh.engine.checkpoint_error import CheckpointError
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes instead of loading.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(slots=True)
class Weights:
    tensors: dict[str, torch.Tensor]
    digest: str  # sha256 hex over sorted (name, shape, dtype, bytes)


def read_json(path: Path, required: bool = True) -> dict:
    """Parse one JSON file; {} when optional and absent."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path.name}: missing in {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path.name}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name}: expected a JSON object")
    return data


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a dir: the index's shards, or the single file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{INDEX_FILE}: missing field 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path.name}: missing (listed in {INDEX_FILE})")
    return files


def _open_all(files: list[Path]) -> Iterator[tuple[Path, object, str]]:
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path.name}: corrupt or truncated safetensors ({exc})") from None
        for name in handle.keys():
            yield path, handle, name


def _hash_tensor(h: "hashlib._Hash", name: str, tensor: torch.Tensor) -> None:
    h.update(json.dumps([name, list(tensor.shape), str(tensor.dtype)]).encode())
    flat = tensor.contiguous().reshape(-1)
    h.update(memoryview(flat.view(torch.uint8).numpy()))


def read_weights(
    model_dir: Path,
    expected: dict[str, torch.Size],
    dtype: torch.dtype,
    ignore: frozenset[str] = frozenset(),
) -> Weights:
    """Read, check and hash every tensor; return them cast to `dtype`.

    `expected` maps the model's parameter names to shapes; a checkpoint tensor
    not in it (nor in `ignore`) or an expected one missing is an error.
    """
    located: dict[str, tuple[Path, object]] = {}
    for path, handle, name in _open_all(weight_files(model_dir)):
        if name in ignore or name.endswith(IGNORED_SUFFIXES):
            continue
        if name not in expected:
            raise CheckpointError(f"{path.name}: unexpected tensor {name!r}")
        shape = tuple(handle.get_slice(name).get_shape())
        if shape != tuple(expected[name]):
            raise CheckpointError(
                f"{path.name}: tensor {name!r} has shape {list(shape)}, "
                f"expected {list(expected[name])}"
            )
        located[name] = (path, handle)
    missing = sorted(set(expected) - set(located))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} in {model_dir.name}")
    h = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(located):
        path, handle = located[name]
        try:
            raw = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path.name}: cannot read tensor {name!r} ({exc})") from None
        _hash_tensor(h, name, raw)
        tensors[name] = raw.to(dtype)
    return Weights(tensors=tensors, digest=h.hexdigest())
