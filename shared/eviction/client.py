"""Asking the eviction service to pin a prefix, for the ingress: a short timeout and `None` instead of an error.

A pin is advice too: without the service, workers still pin locally (engine
and L2), so a caller treats `None` (no service, timeout, remote failure) as
"the global policy did not hear of it" and goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

from nats.aio.client import Client as NATS

from shared.bus.request import RequestError, request
from shared.eviction.messages import PinReply, PinRequest
from shared.log import get_logger
from shared.protocol import subjects

log = get_logger(__name__)


async def pin_prefix(nc: NATS, hashes: Sequence[bytes], ttl_s: float, timeout_s: float = 0.5) -> PinReply | None:
    """Pin `hashes` (a prompt's leading blocks) for `ttl_s` seconds in the global policy."""
    if not hashes:
        return None
    try:
        return await request(nc, subjects.EVICTION_PIN, PinRequest(hashes=[h.hex() for h in hashes], ttl_s=ttl_s),
                             PinReply, timeout_s=timeout_s)
    except RequestError as exc:
        log.info("eviction service unavailable; pin kept locally only", error=str(exc))
        return None
