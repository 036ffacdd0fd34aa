"""The prefill service: `python -m kvmesh.services.prefill` (logic in shared/serving)."""

from kvmesh.protocol.messages import Role
from kvmesh.service.runner import run_service
from kvmesh.serving.services import setup_prefill

raise SystemExit(run_service("prefill", Role.PREFILL, setup_prefill))
