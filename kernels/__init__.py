"""The engine's kernels: torch paths for CPU, Triton kernels for GPU.

- ``kernels.rope.apply_rope(q, k, positions, cos, sin) -> (q, k)``
- ``kernels.kv_write.write_kv(kv_layer, k, v, slot_mapping) -> None``
- ``kernels.paged_attention.paged_attention(q, kv_layer, block_tables, query_lens, context_lens, scale) -> out``
- ``kernels.block_copy.gather_blocks(kv_cache, block_ids) -> blocks`` and ``scatter_blocks(kv_cache, block_ids, blocks)``

Each op picks its implementation in kernels.dispatch; the Triton kernels
live in kernels/triton/ and are imported only when used. KV layout:
shared/engine/forward_batch.py.
"""
