"""Keep an agent session's chain in L1 until it comes back, bringing it back first if it left.

The eviction service predicts when a session's next turn arrives (a tool
call: seconds; an answer: minutes) and sends the worker that will serve it a
`Retain`: pin the chain in L1 until then, and with `fetch`, import what is
no longer in L1 from this worker's L2 or from L3 first (a prefetch). The
import runs through `fetch_chain`, the same windowed path a request's
restore takes, so a prefetch is just a restore done before the request.

A prefetch is advice and costs little when it is wrong: it stops at the
first block no tier has, imports only into what the pool can spare (the
blocks of running requests are never evicted for it), and pins only within
the engine's pin budget; a pin that is never used lapses at `until`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.kv_fetch import Source, fetch_chain


@dataclass(slots=True, frozen=True)
class Retained:
    in_l1: int  # leading blocks of the chain that were in L1 before
    fetched: int  # blocks brought back into L1 by this call
    pinned: int  # leading blocks pinned until the session's expected return


async def retain_chain(engine: EngineLoop, hashes: Sequence[bytes], until: float, sources: Sequence[Source],
                       *, tenant_salt: bytes, window_blocks: int, inflight: int) -> Retained:
    """Pin the chain `hashes` (root first) in L1 until `until` (unix s); with `sources`, fetch its missing run first."""

    def leading_in_l1(e) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in e.cache:
            n += 1
        return n

    in_l1 = await engine.call(leading_in_l1)
    fetched = 0
    lease = f"prefetch:{uuid.uuid4().hex}"  # holds what came back until the pin does
    try:
        if sources and in_l1 < len(hashes):
            got = await fetch_chain(engine, hashes, in_l1, len(hashes), sources, tenant_salt=tenant_salt,
                                    lease=lease, window_blocks=window_blocks, inflight=inflight)
            fetched = len(got.hashes)
        pinned = await engine.call(lambda e: e.pin(hashes, until))
    finally:
        engine.release_lease(lease)
    return Retained(in_l1=in_l1, fetched=fetched, pinned=pinned)
