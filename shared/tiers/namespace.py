"""A tenant's L3 namespace: the name its chunks live under, and what its pins and quota are counted by."""

from __future__ import annotations


def namespace_for(tenant_salt: str) -> str:
    """The L3 namespace of a tenant: derived from its salt (never from anything a client sent)."""
    return f"t-{tenant_salt[:32]}" if tenant_salt else "shared"
