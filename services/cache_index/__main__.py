"""The cache-index service: `python -m kvmesh.services.cache_index` (logic in shared/cache_index)."""

from kvmesh.cache_index.service import setup_cache_index
from kvmesh.protocol.messages import Role
from kvmesh.service.runner import run_service

raise SystemExit(run_service("cache-index", Role.CACHE_INDEX, setup_cache_index))
