"""Asking the cache index, for routers: a short timeout and `None` instead of an error.

Design rule "index down -> route by load": a caller treats `None` (no replica,
timeout, remote failure) exactly like "no worker holds a prefix", and a reply
with `ready=False` (a replica still replaying after a start) as a hint only.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.bus.request import RequestError, request
from kvmesh.cache_index.messages import LookupReply, LookupRequest
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from nats.aio.client import Client as NATS

log = get_logger(__name__)


async def lookup_prefix(nc: NATS, hashes: Sequence[bytes], timeout_s: float = 0.05) -> LookupReply | None:
    """Per worker, how many leading blocks of `hashes` (chain order) it holds, and in which tiers."""
    try:
        return await request(nc, subjects.INDEX_LOOKUP, LookupRequest(hashes=[h.hex() for h in hashes]),
                             LookupReply, timeout_s=timeout_s)
    except RequestError as exc:
        log.info("cache index unavailable; routing without it", error=str(exc))
        return None
