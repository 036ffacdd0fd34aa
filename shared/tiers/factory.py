"""Build a worker's tiers from settings (the one place services wire them)."""

from __future__ import annotations

from kvmesh.cache_policy.registry import get_policy
from kvmesh.config import Settings
from kvmesh.credentials.s3 import read_credentials
from kvmesh.tiers.arena import HeapArena
from kvmesh.tiers.circuit_breaker import CircuitBreaker
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import MissCounters
from kvmesh.tiers.s3_client import fast_fail_client
from kvmesh.tiers.shm_slab import MIN_BLOCK_BYTES, SlabArena


def build_host_tier(settings: Settings, fingerprint: str, worker_id: str, counters: MissCounters,
                    block_bytes: int | None = None) -> HostTier:
    """`block_bytes`: one block's KV payload, so the slab's directory holds as many blocks as L2's bytes do."""
    t = settings.tiers
    arena = (SlabArena(worker_id, t.l2_capacity_bytes, block_bytes or MIN_BLOCK_BYTES) if t.l2_shared_memory
             else HeapArena())
    if isinstance(arena, SlabArena):
        arena.prefault(min(t.l2_prefault_bytes, t.l2_capacity_bytes))
    return HostTier(t.l2_capacity_bytes, get_policy(t.l2_eviction_policy), fingerprint, worker_id, arena, counters)


def build_l3_store(settings: Settings, fingerprint: str, block_size: int, counters: MissCounters) -> L3Store | None:
    """None when L3 is disabled or no credentials are known (the worker then recomputes)."""
    t = settings.tiers
    if not t.l3_enabled:
        return None
    creds = read_credentials(settings.state_dir.resolve())
    access = settings.s3_access_key or (creds.access_key if creds else None)
    secret = settings.s3_secret_key or (creds.secret_key if creds else None)
    if not (access and secret):
        return None
    endpoint = settings.s3_endpoint or f"{settings.s3.host}:{settings.s3.port}"
    return L3Store(
        client=fast_fail_client(endpoint, access, secret, settings.s3_secure),
        bucket=settings.s3.bucket,
        fingerprint=fingerprint,
        chunk_blocks=max(1, t.l3_chunk_tokens // block_size),
        ttl_s=t.l3_ttl_s,
        breaker=CircuitBreaker(t.l3_breaker_failures, t.l3_breaker_reset_s),
        counters=counters,
    )
