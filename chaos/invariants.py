"""Invariant checks over one scenario's recorded outcomes and the stack's state after it healed.

Each check returns a bool; the runner puts them in the report under
`invariants`. The rules: an accepted request ends with the fault-free
tokens or with a retriable error inside its deadline; nothing stays queued
in a work-queue stream; latency comes back: within `RECOVERY_BOUND_S` of the
heal begins a `RECOVERY_WINDOW_S` window whose requests all succeed with a
p99 within 2x the baseline p99; no damaged L3 object outlives the GC window. The index's agreement with the
workers is checked in `chaos.index_truth`.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left

from kvmesh.chaos.load import Outcome
from kvmesh.chaos.stack import stream_backlog
from kvmesh.tiers.block_format import decode_block
from kvmesh.tiers.chunk_format import decode_toc
from kvmesh.tiers.miss import BlockMiss
from minio import Minio

RETRIABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
RECOVERY_WINDOW_S = 10.0  # the window after the heal whose p99 must be back within 2x the baseline's
RECOVERY_BOUND_S = 30.0  # ... and it must begin this soon after the heal
RECOVERY_MIN_REQUESTS = 3  # a window with fewer requests proves nothing


def p99_ms(outcomes: list[Outcome]) -> float | None:
    lat = sorted(o.latency_ms for o in outcomes if o.ok)
    if not lat:
        return None
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def ok_outputs_identical(outcomes: list[Outcome], refs: dict[str, str]) -> bool:
    """Every request that completed produced exactly the greedy reference text."""
    return all(o.text == refs[o.prompt] for o in outcomes if o.ok)


def errors_clean(outcomes: list[Outcome], deadline_s: float) -> bool:
    """Every failed request failed retriably (a 408/429/5xx or a dropped connection) before its deadline."""
    return all((o.status is None or o.status in RETRIABLE_STATUS) and o.ended - o.started <= deadline_s + 1.0
               for o in outcomes if not o.ok)


def recovery_s(outcomes: list[Outcome], healed_at: float, baseline_p99_ms: float,
               window_s: float = RECOVERY_WINDOW_S) -> float | None:
    """Seconds from the heal to the start of the first window of `window_s` that shows latency back.

    The window's requests (those begun in it; at least RECOVERY_MIN_REQUESTS) all succeeded and their
    p99 is within 2x the baseline p99. A window counts only once it is over: some request began after
    it. Windows start at the heal or just after a request began; None when no window qualifies.
    """
    after = sorted((o for o in outcomes if o.started >= healed_at), key=lambda o: o.started)
    if not after:
        return None
    starts = [o.started for o in after]
    for i, t in enumerate([healed_at, *(s + 1e-6 for s in starts)]):
        if t + window_s > starts[-1]:
            return None
        window = after[i:bisect_left(starts, t + window_s)]
        if len(window) >= RECOVERY_MIN_REQUESTS and all(o.ok for o in window) \
                and (p99_ms(window) or 0.0) <= 2 * baseline_p99_ms:
            return t - healed_at
    return None


def nothing_pending(nats_urls: list[str], timeout_s: float = 30.0) -> bool:
    """JOBS and HANDOFF drain to zero messages: no acknowledged job is pending forever."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(asyncio.run(stream_backlog(nats_urls)).values()):
            return True
        time.sleep(0.5)
    return False


def damaged_l3_objects(client: Minio, bucket: str) -> list[str]:
    """Objects in `bucket` that are not intact chunks (read-only: a reader through `L3Store` would delete them)."""
    damaged: list[str] = []
    for item in client.list_objects(bucket, recursive=True):
        resp = client.get_object(bucket, item.object_name)
        try:
            buf = resp.read()
        finally:
            resp.close()
            resp.release_conn()
        try:
            for block_hash, off, size in decode_toc(buf):
                decode_block(memoryview(buf)[off:off + size], None, block_hash)
        except BlockMiss:
            damaged.append(item.object_name)
    return damaged


def l3_intact(client: Minio, bucket: str, timeout_s: float = 30.0) -> bool:
    """No damaged object outlives the GC window: readers quarantine what they hit, the scrub the rest."""
    deadline = time.monotonic() + timeout_s
    while damaged_l3_objects(client, bucket):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True
