"""A KV block as it leaves or enters the engine's pool.

This is what the tiers serialize, what prefill hands to decode, and what
`Engine.export_blocks` / `Engine.import_blocks` exchange. The model
fingerprint is not carried per block: it belongs to the engine (and to the
serialized header, see shared/tiers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KVBlock:
    block_hash: bytes  # 32-byte chained SHA-256 (shared/protocol/block_hash.py)
    parent_hash: bytes | None  # None for the first block of a chain
    token_ids: tuple[int, ...]  # exactly block_size tokens: only full blocks travel
    data: torch.Tensor  # [num_layers, 2, block_size, num_kv_heads, head_dim], NHD, on CPU
