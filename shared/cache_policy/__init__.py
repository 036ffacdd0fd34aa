"""Eviction policies as priority functions: no torch, no NATS, testable alone.

Used by the engine's prefix cache, the eviction service and `kvmesh sim`.
"""
