"""Pins are admitted before a job is queued: the eviction service's ledger says whether the tenant may pin.

Every pin a request asks for (cache_control breakpoints, a named cache) is
first put to the eviction service (`pin_prefix`, shared/eviction/pins.py)
with the tenant's L3 namespace and the prompt's block hashes. Refused up
front, as a 429 `rate_limit_error` in the route's dialect naming the cap:
a pin past the tenant's own cap (its pinned bytes count against its L3
quota), and a named cache the deployment's pin pool cannot hold whole.
Degraded silently: a breakpoint on a pool full for everyone pins the
leading run that fits, and without an eviction service (no answer in
`TIMEOUT_S`) the workers' own caps are the only bound. See
docs/kv-tiers.md, "Pin budgets".
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.eviction.client import pin_prefix, unpin_prefix
from kvmesh.eviction.messages import PinReply
from kvmesh.ingress.admission.admit import Admitted
from kvmesh.ingress.core.errors import ApiError, ErrorKind
from kvmesh.ingress.core.state import IngressState
from kvmesh.log import get_logger
from kvmesh.protocol.serving import CachePin
from kvmesh.tiers.namespace import namespace_for

log = get_logger(__name__)

TIMEOUT_S = 2.0  # a live service answers from memory; no responders fails at once; only a hung one costs this


def prompt_hashes(state: IngressState, ids: Sequence[int], salt: str, known: Sequence[bytes] | None = None
                  ) -> list[bytes]:
    """The full-block hashes of a prompt (as the workers compute them when the ingress knows the model)."""
    return list(known) if known is not None else state.sessions.hasher.extend([], ids, salt)


async def admit_pins(adm: Admitted, pins: Sequence[CachePin], hashes: Sequence[bytes], whole: bool = False) -> None:
    """Pin each pin's prefix in the eviction service for the tenant; 429 when a cap refuses (see above)."""
    if not pins or not hashes:
        return
    bs = adm.state.sessions.hasher.block_size
    tenant = namespace_for(adm.principal.salt)
    for pin in sorted(pins, key=lambda p: -p.num_tokens):  # the longest first: the others only extend it
        prefix = hashes[:pin.num_tokens // bs]
        reply = await pin_prefix(adm.state.gateway.nc, prefix, pin.ttl_s, TIMEOUT_S, tenant=tenant, whole=whole)
        if reply is None or reply.refused is None:
            continue
        if reply.refused == "tenant" or whole:
            raise over_cap(reply, None if whole else "cache_control")
        log.info("breakpoint pinned in part: the pin pool is full", pinned=reply.pinned, wanted=len(prefix))


async def release_pins(state: IngressState, salt: str, hashes: Sequence[bytes]) -> None:
    """Free the tenant's (by `salt`) pins on `hashes`: a deleted named cache; without the service they expire."""
    await unpin_prefix(state.gateway.nc, hashes, namespace_for(salt), TIMEOUT_S)


def over_cap(reply: PinReply, param: str | None) -> ApiError:
    """The 429 for a refused pin: which cap, what is held, what was asked."""
    if reply.refused == "tenant":
        what = ("the tenant's pinned-bytes cap (pins.l3_tenant_fraction of eviction.namespace_quota_bytes, "
                "or pins.l3_tenant_bytes): cached prefixes and named caches count against it")
    else:
        what = "the deployment's pinned-bytes cap (pins.l3_fraction of eviction.l3_capacity_bytes, or pins.l3_pool_bytes)"
    return ApiError(ErrorKind.RATE_LIMIT,
                    f"pin budget exceeded: {what}. {reply.used_bytes} bytes pinned of {reply.cap_bytes}; this "
                    f"request needs {reply.wanted_bytes} more. Delete a named cache or wait for pins to expire.",
                    param=param, code="pin_budget_exceeded")
