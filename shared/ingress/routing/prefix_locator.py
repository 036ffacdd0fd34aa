"""The ingress's side of the cache index: a prompt's block hashes -> who holds them.

The ingress hashes a prompt exactly as the workers do (block_hash.hash_blocks
with the model fingerprint, the tenant's salt, no adapter), so it needs the
fingerprint without loading the model: `model_fingerprint` reads config.json
and streams the safetensors through the same digest the loader computes
(one pass over the files at start-up, nothing kept). A lookup that gets no
answer within `timeout_s` returns None and counts
`kvmesh_ingress_routing_degraded_total`: the router then goes by load.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from kvmesh.cache_index.client import lookup_prefix
from kvmesh.cache_index.messages import LookupReply
from kvmesh.engine.checkpoint import (
    IGNORED_SUFFIXES,
    _hash_tensor,
    _open_all,
    read_json,
    weight_files,
)
from kvmesh.engine.loader import CONFIG_FILE, fingerprint
from kvmesh.engine.model_config import parse_model_config
from kvmesh.protocol.block_hash import HashKeys, hash_blocks
from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry, Counter


def model_fingerprint(model_dir: Path, dtype: str | None = None) -> str:
    """`load_model(model_dir, dtype).fingerprint` without building the model or keeping a tensor."""
    raw = read_json(Path(model_dir) / CONFIG_FILE)
    cfg = parse_model_config(raw, dtype=dtype)
    ignore = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    located = {name: handle for _, handle, name in _open_all(weight_files(Path(model_dir)))
               if name not in ignore and not name.endswith(IGNORED_SUFFIXES)}
    h = hashlib.sha256()
    for name in sorted(located):
        _hash_tensor(h, name, located[name].get_tensor(name))
    return fingerprint(raw, cfg.dtype_name, h.hexdigest())


@dataclass(slots=True)
class PrefixLocator:
    nc: NATS
    fingerprint: str
    block_size: int
    timeout_s: float
    degraded: Counter

    @classmethod
    def create(cls, nc: NATS, fingerprint: str, block_size: int, timeout_s: float,
               registry: CollectorRegistry) -> PrefixLocator:
        degraded = Counter("kvmesh_ingress_routing_degraded", "Prefill routed by load: the cache index did not "
                           "answer in time.", registry=registry)
        return cls(nc, fingerprint, block_size, timeout_s, degraded)

    def hashes(self, prompt_ids: list[int], tenant_salt_hex: str) -> list[bytes]:
        keys = HashKeys(self.fingerprint, bytes.fromhex(tenant_salt_hex))
        return list(hash_blocks(prompt_ids, self.block_size, keys))

    async def lookup(self, prompt_ids: list[int], tenant_salt_hex: str,
                     hashes: list[bytes] | None = None) -> LookupReply | None:
        """Who holds the prompt's prefix; `hashes`: its block hashes if already computed (by `hashes`)."""
        if hashes is None:
            hashes = self.hashes(prompt_ids, tenant_salt_hex)
        if not hashes:
            return LookupReply(workers=[], l3_blocks=0, indexed_blocks=0, ready=True)  # nothing to find
        reply = await lookup_prefix(self.nc, hashes, self.timeout_s)
        if reply is None:
            self.degraded.inc()
        return reply
