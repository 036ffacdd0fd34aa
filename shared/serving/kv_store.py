"""Finished blocks out of the engine into this worker's tiers, a window at a time.

A worker registers a chain (the prompt's blocks after prefill, prompt +
output after decode) by exporting the blocks its L2 lacks and handing them
to `WorkerTiers.register` (L2, then the L3 upload queue). At real model
geometry a 16k-token chain is 2 GiB at 8B: exported in one piece it would
need a second 2 GiB host copy next to the pool and L2. Exported
`window_blocks` at a time, the copy in flight is bounded (64 blocks = 128 MiB
at 8B). Each window is exported as the leading run of what is still
missing, so a block the engine dropped meanwhile ends the chain there, as a
single export would have. A pool in host memory is not copied out at all:
the window's blocks are held under a lease and encoded from the pool straight
into L2.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from kvmesh.protocol.blocks import BlockHandle
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.worker_tiers import WorkerTiers

WINDOW_BLOCKS = 64


async def store_chain(engine: EngineLoop, tiers: WorkerTiers, hashes: Sequence[bytes], tenant_salt: str,
                      window_blocks: int = WINDOW_BLOCKS, session_id: str | None = None, keep_chain: bool = False
                      ) -> tuple[list[BlockHandle], list]:
    """`register` the chain `hashes` (position 0 first) for `session_id` (named in its KV events); returns
    what the last `register` returned: the handles of the leading run L2 holds, and the chain (every
    block's encoded bytes with `keep_chain`: see `WorkerTiers.register`)."""
    hashes = list(hashes)
    missing = tiers.missing(hashes)
    at = {h: i for i, h in enumerate(hashes)}
    on_host = engine.engine.kv_cache.device.type == "cpu"
    lease = f"store:{uuid.uuid4().hex}"
    with tiers.storing_chain():
        try:
            for start in range(0, len(missing), window_blocks):
                part = missing[start:start + window_blocks]
                if on_host:  # views of the pool under a lease: each block is copied once, into L2
                    exported = await engine.call(lambda e, p=part: e.lease_views(p, lease))
                else:  # the copy to the host may finish off the engine thread (CUDA side stream)
                    pending = await engine.call(lambda e, p=part: e.start_export(p))
                    exported = await asyncio.to_thread(pending.wait)
                if not exported:
                    break
                tiers.register(hashes[:at[exported[-1].block_hash] + 1], exported, tenant_salt, session_id)
                if on_host:
                    engine.release_lease(lease)
                if len(exported) < len(part):
                    break
        finally:
            if on_host:
                engine.release_lease(lease)
        return tiers.register(hashes, [], tenant_salt, session_id, keep_chain)


async def store_tokens(engine: EngineLoop, tiers: WorkerTiers, token_ids: Sequence[int], salt: bytes,
                       tenant_salt: str, session_id: str | None = None) -> list[BlockHandle]:
    """`store_chain` the full blocks of `token_ids` (prompt + output: the next turn's prefix); the handles L2 holds."""
    hashes = await engine.call(lambda e: e.block_hashes(list(token_ids), salt))
    handles, _ = await store_chain(engine, tiers, hashes, tenant_salt, session_id=session_id)
    return handles
