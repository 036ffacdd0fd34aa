"""The cache-index service: `python -m services.cache_index` (logic in shared/cache_index)."""

from shared.cache_index.service import setup_cache_index
from shared.protocol.messages import Role
from shared.service.runner import run_service

raise SystemExit(run_service("cache-index", Role.CACHE_INDEX, setup_cache_index))
