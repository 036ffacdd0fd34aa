"""kvmesh as another engine's KV layer: the engine keeps its own cache, kvmesh keeps what it cannot."""
