"""The eviction service process: `python -m kvmesh.services.eviction` (logic in shared/eviction)."""

from kvmesh.eviction.setup import setup
from kvmesh.protocol.messages import Role
from kvmesh.service.runner import run_service

if __name__ == "__main__":
    raise SystemExit(run_service("eviction", Role.EVICTION, setup))
