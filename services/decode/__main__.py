"""The decode service: `python -m kvmesh.services.decode` (logic in shared/serving)."""

from kvmesh.protocol.messages import Role
from kvmesh.service.runner import run_service
from kvmesh.serving.services import setup_decode

raise SystemExit(run_service("decode", Role.DECODE, setup_decode))
