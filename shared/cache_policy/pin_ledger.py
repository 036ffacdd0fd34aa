"""Pinned bytes per tenant and per pool, with caps, counted until the pins expire.

One ledger per pool of pinned blocks: a worker's L1 (shared/engine/pins.py),
its L2 (shared/serving/pinning.py), or the whole deployment's L3 pins in the
eviction service (shared/eviction/pins.py). A block is counted once, under
the tenant that pinned it first (block hashes carry the tenant's salt, so two
tenants share a block only by opt-in); pinning it again only moves its
deadline later and costs nothing. Invariants, whatever the order of grants
and expiries: the pool's pinned bytes never exceed `pool_cap`, a tenant's
never exceed `tenant_cap`, and they sum to the pool's.

`tenant_cap` binds every tenant but "", the system's own pins (a policy's
session retains), which only the pool's cap binds.

`grant` takes a chain's leading run (a pinned prefix is a hit; a tail without
its prefix is not). A tenant past its own cap gets nothing (`Cap.TENANT`: the
caller refuses the request), or with `trim` the leading run that fits (a
worker degrading); a pool full for everyone gets the leading run that fits
(`Cap.POOL`), or nothing when the caller asks for all or nothing (`whole`).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


class Cap(enum.Enum):
    """Which cap stopped a grant."""

    TENANT = "tenant"
    POOL = "pool"


@dataclass(frozen=True, slots=True)
class PinGrant:
    """`granted` leading blocks are pinned (`new_bytes` of them newly counted); `refused` says what stopped the rest."""

    granted: int
    new_bytes: int = 0
    refused: Cap | None = None
    wanted_bytes: int = 0  # new bytes the whole request would have needed (for the error message)


@dataclass(slots=True)
class _Pin:
    tenant: str
    size: int
    until: float


@dataclass
class PinLedger:
    """Pins of one pool; `None` caps are unbounded. Times are whatever clock the caller uses, consistently."""

    pool_cap: int | None
    tenant_cap: int | None
    _pins: dict[bytes, _Pin] = field(default_factory=dict, init=False, repr=False)
    _expiry: list[tuple[float, bytes]] = field(default_factory=list, init=False, repr=False)
    _tenant_bytes: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _bytes: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("pool_cap", "tenant_cap"):
            cap = getattr(self, name)
            if cap is not None and cap < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {cap}")

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._pins

    def until(self, block_hash: bytes) -> float:
        pin = self._pins.get(block_hash)
        return 0.0 if pin is None else pin.until

    def used(self) -> int:
        """Pinned bytes of the pool (as of the last `expire`)."""
        return self._bytes

    def tenant_used(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def tenants(self) -> dict[str, int]:
        return dict(self._tenant_bytes)

    def grant(self, tenant: str, hashes: Sequence[bytes], size: int, until: float, now: float,
              whole: bool = False, trim: bool = False) -> PinGrant:
        """Pin the leading run of `hashes` (`size` bytes each) for `tenant` until `until`, within both caps.

        Blocks already pinned are extended (by any tenant: the block is the same) and cost nothing.
        """
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.expire(now)
        if until <= now:  # pins nothing new and never shortens one: the leading run already pinned stands
            held = 0
            while held < len(hashes) and hashes[held] in self._pins:
                held += 1
            return PinGrant(held)
        # Bytes a full grant would add: distinct hashes not yet pinned.
        fresh = [h for h in dict.fromkeys(hashes) if h not in self._pins]
        wanted = size * len(fresh)
        tenant_room = None
        if tenant and self.tenant_cap is not None:
            tenant_room = self.tenant_cap - self.tenant_used(tenant)
            if wanted > tenant_room and (whole or not trim):
                return PinGrant(0, 0, Cap.TENANT, wanted)
        room = None if self.pool_cap is None else self.pool_cap - self._bytes
        if whole and room is not None and wanted > room:
            return PinGrant(0, 0, Cap.POOL, wanted)
        granted = new = 0
        refused = None
        for h in hashes:
            pin = self._pins.get(h)
            if pin is None:
                if tenant_room is not None and new + size > tenant_room:
                    refused = Cap.TENANT
                    break
                if room is not None and new + size > room:
                    refused = Cap.POOL
                    break
                self._pins[h] = _Pin(tenant, size, until)
                self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
                self._bytes += size
                new += size
                heapq.heappush(self._expiry, (until, h))
            elif until > pin.until:
                pin.until = until
                heapq.heappush(self._expiry, (until, h))
            granted += 1
        return PinGrant(granted, new, refused, wanted)

    def release(self, hashes: Sequence[bytes], tenant: str | None = None) -> list[bytes]:
        """Unpin `hashes` now (only `tenant`'s, when given); the hashes released."""
        out = []
        for h in dict.fromkeys(hashes):
            pin = self._pins.get(h)
            if pin is not None and (tenant is None or pin.tenant == tenant):
                self._drop(h, pin)
                out.append(h)
        return out

    def expire(self, now: float) -> list[bytes]:
        """Forget the pins whose deadline is at or before `now`; the hashes released."""
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            until, h = heapq.heappop(self._expiry)
            pin = self._pins.get(h)
            if pin is not None and pin.until == until:  # else extended (a later heap entry) or released
                self._drop(h, pin)
                out.append(h)
        return out

    def _drop(self, h: bytes, pin: _Pin) -> None:
        del self._pins[h]
        left = self._tenant_bytes[pin.tenant] - pin.size
        if left:
            self._tenant_bytes[pin.tenant] = left
        else:
            del self._tenant_bytes[pin.tenant]
        self._bytes -= pin.size
