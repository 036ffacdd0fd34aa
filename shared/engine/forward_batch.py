"""The contract between the scheduler and the model for one forward step.

A step runs several sequences at once, flattened (varlen): sequence i
contributes ``query_lens[i]`` new tokens, which sit after
``context_lens[i] - query_lens[i]`` tokens already in the paged KV cache.
The model writes the new tokens' K/V at ``slot_mapping`` before attending,
so prefill over a cached prefix, chunked prefill and decode are one path.

KV cache layout (one tensor for the whole pool, NHD inside a block):
    kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    index 0 of dim 1 is K, 1 is V.  Slot s = block_id * block_size + offset.
An exported block (tiers, handoff) is kv_cache[:, :, block_id] with shape
    [num_layers, 2, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    query_lens: torch.Tensor  # [S] int32, new tokens per sequence (sum = T)
    context_lens: torch.Tensor  # [S] int32, cached + new tokens per sequence after this step
    block_tables: torch.Tensor  # [S, max_blocks] int32, block ids; unused entries are 0
    slot_mapping: torch.Tensor  # [T] int64, cache slot for each new token's K/V
    logits_indices: torch.Tensor  # [S] int64, index into T of each sequence's last new token

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
