"""The service's pin table: which blocks no advice may demote and no L3 GC may delete, until when.

Two kinds of pin. A tenant's (`EVICTION_PIN`: cache_control breakpoints and
named caches) is counted in bytes in a `PinLedger` against the tenant's cap
and the deployment's: every such block is kept in L3 while pinned, so these
are the L3 caps (`caps_for`), and a named cache counts against its tenant's
L3 quota. A session retain (`Retain` advice) is the service's own decision,
bounded by the workers' pin budgets, and charged to no tenant. Pins only
ever extend; `expire` forgets the ones whose time has passed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.cache_policy.pin_ledger import PinGrant, PinLedger
from kvmesh.config import EvictionSettings, PinQuotaSettings


def caps_for(eviction: EvictionSettings, pins: PinQuotaSettings) -> tuple[int | None, int]:
    """(pool cap, tenant cap) in bytes for the deployment's tenant pins.

    Pool: `l3_fraction` of the L3 budget, or `l3_pool_bytes` without one. Tenant: `l3_tenant_fraction`
    of the tenant's L3 quota (what it pins counts against the quota), or `l3_tenant_bytes` without one.
    """
    pool = (pins.l3_pool_bytes if eviction.l3_capacity_bytes is None
            else int(eviction.l3_capacity_bytes * pins.l3_fraction))
    tenant = (pins.l3_tenant_bytes if eviction.namespace_quota_bytes is None
              else int(eviction.namespace_quota_bytes * pins.l3_tenant_fraction))
    return pool, tenant


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_block_bytes(model_dir: Path, dtype: str, block_size: int) -> int:
    """KV bytes of one block of the checkpoint in `model_dir` (its config.json; no weights, no torch)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim
    return per_token * _DTYPE_BYTES[dtype.removeprefix("torch.")] * block_size


@dataclass(slots=True)
class PinTable:
    """`tenants` holds the tenants' pins under their caps; `block_bytes` sizes a pin that does not say."""

    tenants: PinLedger = field(default_factory=lambda: PinLedger(None, None))
    block_bytes: int = 1
    _retained: dict[bytes, float] = field(default_factory=dict)

    @classmethod
    def with_caps(cls, eviction: EvictionSettings, pins: PinQuotaSettings, block_bytes: int) -> PinTable:
        return cls(PinLedger(*caps_for(eviction, pins)), pins.block_bytes or block_bytes)

    def __len__(self) -> int:
        return len(self.tenants) + len(self._retained)

    def pin(self, hashes: Iterable[bytes], until: float) -> int:
        """A session retain: kept until `until`, charged to no tenant."""
        n = 0
        for h in hashes:
            self._retained[h] = max(self._retained.get(h, 0.0), until)
            n += 1
        return n

    def pin_for(self, tenant: str, hashes: Sequence[bytes], block_bytes: int, until: float, now: float,
                whole: bool = False) -> PinGrant:
        """A tenant's pin, within its cap and the pool's (see `PinLedger.grant`)."""
        return self.tenants.grant(tenant, hashes, block_bytes, until, now, whole)

    def release(self, tenant: str, hashes: Sequence[bytes]) -> int:
        return len(self.tenants.release(hashes, tenant))

    def pinned(self, block_hash: bytes, now: float) -> bool:
        return self.until(block_hash) > now

    def any_pinned(self, hashes: Iterable[bytes], now: float) -> bool:
        return any(self.pinned(h, now) for h in hashes)

    def until(self, block_hash: bytes) -> float:
        return max(self._retained.get(block_hash, 0.0), self.tenants.until(block_hash))

    def expire(self, now: float) -> int:
        done = [h for h, t in self._retained.items() if t <= now]
        for h in done:
            del self._retained[h]
        return len(done) + len(self.tenants.expire(now))
