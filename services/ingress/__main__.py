"""The ingress service: `python -m services.ingress` (logic in shared/ingress)."""

from shared.ingress.service import setup
from shared.protocol.messages import Role
from shared.service.runner import run_service

raise SystemExit(run_service("ingress", Role.INGRESS, setup))
