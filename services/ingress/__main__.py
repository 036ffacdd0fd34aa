"""The ingress service: `python -m kvmesh.services.ingress` (logic in shared/ingress)."""

from kvmesh.ingress.server.service import setup
from kvmesh.protocol.messages import Role
from kvmesh.service.runner import run_service

raise SystemExit(run_service("ingress", Role.INGRESS, setup))
