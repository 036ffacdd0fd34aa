"""Which KV a vLLM engine's block is: the model's fingerprint, the tenant's salt, kvmesh's chained hash.

vLLM's own block hashes depend on its settings (hash algorithm, a random seed
for some of them). kvmesh hashes the tokens itself with the chained hash every
kvmesh part uses (shared/protocol/block_hash.py), so a block vLLM computed has
the same name in the connector, the cache index and the ingress's router.

The fingerprint covers the checkpoint's config and weight bytes, the KV dtype
and the engine ("vllm"): KV from kvmesh's own engine agrees with vLLM's to
about 1e-5, not bit for bit, so the two engines' blocks are kept apart and a
vLLM reader gets exactly what vLLM computed.

A tenant's salt arrives as vLLM's `cache_salt` (the OpenAI body field, or the
prompt option offline). kvmesh's ingress passes its own tenant salt, a hex
string, which is used as it is so the ingress's hashes match; any other string
is hashed into one.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Sequence
from pathlib import Path

from kvmesh.protocol.block_hash import HashKeys, hash_blocks

ENGINE = "vllm"


def model_fingerprint(model_dir: Path, kv_dtype: str) -> str:
    """sha256 over config.json, every weight file's bytes (sorted by name), the KV dtype and the engine."""
    weights = sorted([*model_dir.glob("*.safetensors"), *model_dir.glob("*.bin")])
    if not (model_dir / "config.json").is_file() or not weights:
        raise ValueError(f"KVMeshConnector names KV by the checkpoint's bytes: give vLLM a local checkpoint dir "
                         f"(config.json and *.safetensors or *.bin), not {model_dir}")
    h = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    h.update(json.dumps({"config": config, "kv_dtype": kv_dtype, "engine": ENGINE},
                        sort_keys=True, separators=(",", ":")).encode())
    for path in weights:
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def tenant_salt_hex(cache_salt: str | None) -> str:
    """The kvmesh tenant salt (hex) of a request's `cache_salt`; "" (the shared namespace) for none."""
    if not cache_salt:
        return ""
    if len(cache_salt) % 2 == 0 and all(c in string.hexdigits for c in cache_salt):
        return cache_salt.lower()
    return hashlib.sha256(cache_salt.encode()).hexdigest()[:32]


def chain_hashes(token_ids: Sequence[int], block_size: int, fingerprint: str, salt_hex: str,
                 parent: bytes | None = None) -> list[bytes]:
    """kvmesh's chained hashes of the full blocks of `token_ids` for this tenant (after `parent`, if given)."""
    return hash_blocks(token_ids, block_size, HashKeys(fingerprint, bytes.fromhex(salt_hex)), parent)
