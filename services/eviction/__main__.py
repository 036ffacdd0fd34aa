"""The eviction service process: `python -m services.eviction` (logic in shared/eviction)."""

from shared.eviction.setup import setup
from shared.protocol.messages import Role
from shared.service.runner import run_service

if __name__ == "__main__":
    raise SystemExit(run_service("eviction", Role.EVICTION, setup))
