"""Asking the eviction service to pin (or unpin) a prefix: a short timeout and `None` instead of an error.

A pin is advice and a budget check: without the service, workers still pin
locally within their own caps (engine and L2), so a caller treats `None`
(no service, timeout, remote failure) as "the global policy did not hear of
it" and goes on. A reply with `refused` set is the service's answer: the
tenant's cap or the pool's stopped the pin (the ingress turns a tenant
refusal into a 429).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.bus.request import RequestError, request
from kvmesh.eviction.messages import PinReply, PinRequest
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from nats.aio.client import Client as NATS

log = get_logger(__name__)


async def pin_prefix(nc: NATS, hashes: Sequence[bytes], ttl_s: float, timeout_s: float = 0.5, *, tenant: str = "",
                     block_bytes: int = 0, whole: bool = False) -> PinReply | None:
    """Pin `hashes` (a prompt's leading blocks) for `ttl_s` seconds for `tenant` (an L3 namespace).

    `block_bytes` 0: the service's own size of a block. `whole`: all or nothing.
    """
    if not hashes:
        return None
    return await _ask(nc, PinRequest(hashes=[h.hex() for h in hashes], ttl_s=ttl_s, tenant=tenant,
                                     block_bytes=block_bytes, whole=whole), timeout_s)


async def unpin_prefix(nc: NATS, hashes: Sequence[bytes], tenant: str, timeout_s: float = 0.5) -> PinReply | None:
    """Release `tenant`'s pins on `hashes` now (a deleted named cache): its budget is free again."""
    if not hashes:
        return None
    return await _ask(nc, PinRequest(hashes=[h.hex() for h in hashes], ttl_s=1.0, tenant=tenant, release=True),
                      timeout_s)


async def _ask(nc: NATS, req: PinRequest, timeout_s: float) -> PinReply | None:
    try:
        return await request(nc, subjects.EVICTION_PIN, req, PinReply, timeout_s=timeout_s)
    except RequestError as exc:
        log.info("eviction service unavailable; pin kept locally only", error=str(exc))
        return None
