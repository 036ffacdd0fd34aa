"""Trace replay for eviction policies: no model, no bus (see ``kvmesh sim``)."""
