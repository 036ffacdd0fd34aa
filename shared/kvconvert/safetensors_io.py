"""KV blocks <-> one safetensors file: tensor "kv" [n, *block shape] + JSON metadata.

The header's "kvmesh" entry holds format version, fingerprint, layout, dtype,
block size, and per block its hash, parent hash and token ids, so any engine
(or tool) can check what it is importing. All blocks of a file share model,
layout, dtype and block size.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from kvmesh.kvconvert.errors import IncompatibleKV
from kvmesh.tiers.block_format import BlockHeader, StoredBlock
from safetensors import safe_open
from safetensors.torch import save_file

FILE_FORMAT = "kvmesh-kv"
FILE_VERSION = 1
_SHARED = ("fingerprint", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "layout")


def export_safetensors(blocks: list[StoredBlock], path: Path) -> None:
    if not blocks:
        raise IncompatibleKV("nothing to export: no blocks")
    first = blocks[0].header
    for b in blocks[1:]:
        diff = [f for f in _SHARED if getattr(b.header, f) != getattr(first, f)]
        if diff:
            raise IncompatibleKV(f"blocks differ in {', '.join(diff)}: one file holds one model/layout/dtype/block size")
    meta = {
        "format": FILE_FORMAT, "version": FILE_VERSION, **{f: getattr(first, f) for f in _SHARED},
        "hashes": [b.header.block_hash.hex() for b in blocks],
        "parents": [b.header.parent_hash.hex() if b.header.parent_hash else None for b in blocks],
        "token_ids": [list(b.header.token_ids) for b in blocks],
    }
    kv = torch.stack([b.data for b in blocks])
    save_file({"kv": kv}, str(path), metadata={"kvmesh": json.dumps(meta, separators=(",", ":"))})


def import_safetensors(path: Path, fingerprint: str | None = None) -> list[StoredBlock]:
    """Blocks of a file; `fingerprint` set: refuse another model's KV."""
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("kvmesh")
        if raw is None:
            raise IncompatibleKV(f"{path}: not a kvmesh KV file (no 'kvmesh' metadata)")
        meta = json.loads(raw)
        if meta.get("format") != FILE_FORMAT or meta.get("version") != FILE_VERSION:
            raise IncompatibleKV(f"{path}: format {meta.get('format')} v{meta.get('version')}, "
                                 f"this build reads {FILE_FORMAT} v{FILE_VERSION}")
        if fingerprint is not None and meta["fingerprint"] != fingerprint:
            raise IncompatibleKV(f"fingerprint mismatch: file {meta['fingerprint'][:12]}.. vs target {fingerprint[:12]}..")
        kv = f.get_tensor("kv")
    proto = BlockHeader(meta["fingerprint"], b"", None, (), meta["num_layers"], meta["num_kv_heads"],
                        meta["head_dim"], meta["block_size"], meta["dtype"], meta["layout"])
    if tuple(kv.shape[1:]) != proto.shape or len(meta["hashes"]) != kv.shape[0]:
        raise IncompatibleKV(f"{path}: tensor {tuple(kv.shape)} does not match metadata "
                             f"({len(meta['hashes'])} blocks of {proto.shape})")
    out = []
    for i, (h, p, toks) in enumerate(zip(meta["hashes"], meta["parents"], meta["token_ids"])):
        header = replace(proto, block_hash=bytes.fromhex(h), parent_hash=bytes.fromhex(p) if p else None,
                         token_ids=tuple(toks))
        out.append(StoredBlock(header, kv[i]))
    return out
